"""Embeddings: `LLM.embed` against sentence-transformers' `encode()` on tiny random checkpoints written here (each
pooling mode, normalized and not), embedding and generation requests sharing one engine, and the openai client's
`embeddings.create` against a live server."""
import base64
import json
import warnings
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_all_blocks_free
from inferno import LLM
from inferno.pooling_params import PoolingParams
from inferno.sampling_params import SamplingParams
from test_parallel import LAYOUTS, parallel_llm
from test_server import RemoteServer
from tiny_models import write_hf_model

# one text per byte-level token; long ones are computed in several chunks (ENGINE's max_num_batched_tokens)
TEXTS = ["hello", "The capital of France is Paris.", "a" * 3, "embeddings " * 9 + "end", "Pooling, chunk by chunk: " * 4]
ENGINE = dict(max_num_batched_tokens=24, kv_cache_memory=8 << 20, dtype="float32", kv_cache_dtype="float32")
MIN_COSINE = 0.9999


def write_sentence_transformer(folder: Path, arch: str, pooling_mode: str, normalize: bool):
    """A random `arch` model saved by sentence-transformers (Transformer, Pooling, optionally Normalize); returns
    the SentenceTransformer, the oracle."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers import SentenceTransformer, models
    write_hf_model(folder / "hf", arch, tie_word_embeddings=True)
    # the plain fast tokenizer (a llama one would add a BOS token inferno's byte-level tokenizer has not), with a
    # pad token sentence-transformers asks for (it pads batches; these are encoded one at a time)
    config = folder / "hf" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "PreTrainedTokenizerFast",
                                  "pad_token": "<|endoftext|>"}))
    modules = [models.Transformer(str(folder / "hf")), models.Pooling(64, pooling_mode=pooling_mode)]
    model = SentenceTransformer(modules=modules + [models.Normalize()] * normalize, device="cpu")
    model.save(str(folder / "st"))
    return model


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.double(), b.double(), dim=-1)


def vectors(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


@pytest.mark.parametrize("arch, pooling_mode, normalize", [
    ("qwen3", "lasttoken", True),  # Qwen3-Embedding's
    ("llama", "lasttoken", False),
    ("llama", "mean", True),
    ("qwen3", "mean", False),
    ("qwen3", "cls", True),
])
def test_embed_matches_sentence_transformers(tmp_path, arch, pooling_mode, normalize):
    oracle = write_sentence_transformer(tmp_path, arch, pooling_mode, normalize)
    expected = torch.from_numpy(oracle.encode(TEXTS, batch_size=1, convert_to_numpy=True))
    llm = LLM(model=str(tmp_path / "st"), runner="pooling", **ENGINE)
    outputs = llm.embed(TEXTS)
    got = vectors(outputs)
    assert got.shape == expected.shape
    assert cosines(got, expected).min() >= MIN_COSINE
    torch.testing.assert_close(got.norm(dim=-1), expected.norm(dim=-1), rtol=1e-3, atol=0)
    assert [o.prompt_token_ids for o in outputs] == [list(t.encode()) for t in TEXTS]
    assert all(o.finished for o in outputs)
    # again: last-token pooling now finds the prompts' blocks in the prefix cache, mean and CLS compute them all
    again = vectors(llm.embed(TEXTS))
    assert cosines(again, got).min() >= 1 - 1e-6
    assert_all_blocks_free(llm.llm_engine)


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> Path:
    """A generation model (no sentence-transformers files): embeddings pool the last token, normalized."""
    folder = tmp_path_factory.mktemp("qwen3")
    write_hf_model(folder, "qwen3")
    return folder


@torch.inference_mode()
def hf_last_token_states(folder: Path, prompts: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModel
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    return torch.stack([model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts])


@pytest.mark.parametrize("enable_prefix_caching", [True, False])  # False: embeddings write no K/V beside generation's
def test_generation_model_embeds_its_last_token_and_mixes_with_generation(qwen3_folder, enable_prefix_caching):
    llm = LLM(model=str(qwen3_folder), enable_prefix_caching=enable_prefix_caching, **ENGINE)
    prompts = [list(t.encode()) for t in TEXTS]
    expected = F.normalize(hf_last_token_states(qwen3_folder, prompts), dim=-1)
    alone = vectors(llm.embed([{"prompt_token_ids": p} for p in prompts]))
    assert cosines(alone, expected).min() >= MIN_COSINE
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    generated = [o.outputs[0].token_ids for o in llm.generate(TEXTS[:3], params)]
    llm.reset_prefix_cache()
    # both kinds in one engine at once: interleaved, chunked, sharing steps
    engine = llm.llm_engine
    for i, text in enumerate(TEXTS):
        if i < 3:
            engine.add_request(f"gen-{i}", text, params)
        engine.add_request(f"embed-{i}", text, PoolingParams())
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert [finished[f"gen-{i}"].outputs[0].token_ids for i in range(3)] == generated
    mixed = torch.stack([finished[f"embed-{i}"].outputs.data for i in range(len(TEXTS))])
    assert cosines(mixed, alone).min() >= 1 - 1e-6
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_embeddings_follow_float32(qwen3_folder, dtype):
    """The whole prompt in one chunk whose K/V nothing reads again (no prefix caching: none is written): the
    attention kernels must take the chunk's K/V from the step, not from the cache (bfloat16 once read garbage there
    on AVX512-BF16 CPUs). Half precision keeps the direction of each vector."""
    llm = LLM(model=str(qwen3_folder), enable_prefix_caching=False, **{**ENGINE, "dtype": dtype,
                                                                       "kv_cache_dtype": "auto"})
    prompts = [list(t.encode()) for t in TEXTS]
    expected = F.normalize(hf_last_token_states(qwen3_folder, prompts), dim=-1)
    assert cosines(vectors(llm.embed([{"prompt_token_ids": p} for p in prompts])), expected).min() >= 0.99
    assert_all_blocks_free(llm.llm_engine)


def test_dimensions_need_a_matryoshka_model(qwen3_folder, tmp_path):
    llm = LLM(model=str(qwen3_folder), **ENGINE)
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.embed("hello", PoolingParams(dimensions=16))
    assert_all_blocks_free(llm.llm_engine)
    folder = tmp_path / "matryoshka"
    write_hf_model(folder, "qwen3")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    llm = LLM(model=str(folder), **ENGINE)
    full = vectors(llm.embed(TEXTS, PoolingParams(normalize=False)))
    cut = vectors(llm.embed(TEXTS, PoolingParams(dimensions=16)))
    torch.testing.assert_close(cut, F.normalize(full[:, :16], dim=-1), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="dimensions must be one of"):
        llm.embed("hello", PoolingParams(dimensions=20))


def test_pooling_runner_generates_and_compiles_nothing(qwen3_folder):
    # the compiled decode step allowed: an embedding model never decodes, so its warm-up compiles nothing that
    # would take cores from the prompts
    llm = LLM(model=str(qwen3_folder), runner="pooling", **ENGINE, enforce_eager=False)
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed({"prompt_token_ids": [1] * (llm.llm_engine.max_model_len + 1)})
    # a prompt may fill the whole context: nothing is generated after it
    full = llm.embed({"prompt_token_ids": [7] * llm.llm_engine.max_model_len})
    assert len(full[0].outputs.embedding) == 64
    assert_all_blocks_free(llm.llm_engine)
    assert not llm.wait_for_warm_up()  # True when decode steps run compiled


def kv_written(llm: LLM) -> bool:
    """Whether any K/V reached the cache (it starts zeroed)."""
    return any(cache.any() for cache in llm.llm_engine.model_runner.kv_caches())


@pytest.mark.parametrize("attention_backend", ["cpu_kernel", "torch"])
def test_pooling_runner_writes_kv_only_where_it_is_read(qwen3_folder, attention_backend):
    """Prompts computed whole write no K/V (the pooling runner keeps no prefix cache by default); a prompt chunked
    over steps writes what its next chunk reads and embeds the same; with prefix caching asked for, K/V is written
    and a repeated prompt hits it."""
    prompts = [{"prompt_token_ids": list(t.encode())} for t in TEXTS]
    expected = F.normalize(hf_last_token_states(qwen3_folder, [p["prompt_token_ids"] for p in prompts]), dim=-1)
    engine = {**ENGINE, "attention_backend": attention_backend}
    whole = LLM(model=str(qwen3_folder), runner="pooling", **{**engine, "max_num_batched_tokens": 256})
    assert not whole.llm_engine.config.enable_prefix_caching
    unchunked = vectors(whole.embed(prompts))  # every prompt in one step
    assert cosines(unchunked, expected).min() >= MIN_COSINE
    assert not kv_written(whole)
    assert_all_blocks_free(whole.llm_engine)

    chunked = LLM(model=str(qwen3_folder), runner="pooling", **engine)  # 24 tokens a step: long prompts in chunks
    assert cosines(vectors(chunked.embed(prompts)), unchunked).min() >= 1 - 1e-6
    assert kv_written(chunked)
    assert_all_blocks_free(chunked.llm_engine)

    cached = LLM(model=str(qwen3_folder), runner="pooling", enable_prefix_caching=True,
                 **{**engine, "max_num_batched_tokens": 256})
    assert cosines(vectors(cached.embed(prompts)), unchunked).min() >= 1 - 1e-6
    assert kv_written(cached)
    manager = cached.llm_engine.kv_cache_manager
    hits = manager.prefix_cache_hits
    assert cosines(vectors(cached.embed(prompts)), unchunked).min() >= 1 - 1e-6
    assert manager.prefix_cache_hits > hits  # the long prompts' full blocks, read back
    assert_all_blocks_free(cached.llm_engine)


def test_gguf_embeddings_follow_the_float_model(llm, hf_model):
    """The default model's GGUF file, as the session's float32 engine loads it, against HF's last hidden state;
    and the same vectors whether the prompts run alone or batched."""
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(t) for t in TEXTS]
    batched = vectors(llm.embed([{"prompt_token_ids": p} for p in prompts]))
    with torch.inference_mode():
        expected = torch.stack([hf_model.model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts])
    assert cosines(batched, F.normalize(expected, dim=-1)).min() >= MIN_COSINE
    llm.reset_prefix_cache()
    alone = torch.cat([vectors(llm.embed({"prompt_token_ids": p})) for p in prompts])
    assert cosines(alone, batched).min() >= 1 - 1e-6


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_embeddings_match_one_process(tmp_path, layout):
    """Rank 0 pools: with tensor parallelism it holds the whole hidden states, with pipeline stages the last stage
    sends the pooled rows back with the logit rows (a generation request shares the steps)."""
    write_sentence_transformer(tmp_path, "qwen3", "mean", True)
    model = str(tmp_path / "st")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    single = LLM(model=model, **ENGINE)
    expected, generated = vectors(single.embed(TEXTS)), single.generate(TEXTS[1], params)[0].outputs[0].token_ids
    with parallel_llm(model=model, **ENGINE, **LAYOUTS[layout]) as llm:
        engine = llm.llm_engine
        engine.add_request("gen", TEXTS[1], params)
        for i, text in enumerate(TEXTS):
            engine.add_request(str(i), text, PoolingParams())
        finished = {}
        while engine.has_unfinished_requests():
            finished |= {o.request_id: o for o in engine.step() if o.finished}
        got = torch.stack([finished[str(i)].outputs.data for i in range(len(TEXTS))])
        assert cosines(got, expected).min() >= 1 - 1e-5
        assert finished["gen"].outputs[0].token_ids == generated
        assert_all_blocks_free(engine)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("st")
    write_sentence_transformer(folder, "qwen3", "lasttoken", True)
    server = RemoteServer("--model", str(folder / "st"), "--runner", "pooling", "--max-model-len", "128",
                          "--kv-cache-memory", str(8 << 20), "--dtype", "float32")
    yield server
    server.close()


def test_openai_client_embeddings_float_and_base64_agree(server):
    """The same request three ways, each computed afresh (a prefix-cache hit computes the last token over cached
    K/V, which rounds differently): floats, base64 decoded by the client, base64 decoded here."""
    client = server.client()
    httpx.post(f"{server.url}/reset_prefix_cache")
    floats = client.embeddings.create(model="st", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert floats.model == "st" and floats.object == "list"
    num_tokens = sum(len(t.encode()) for t in TEXTS)
    assert (floats.usage.prompt_tokens, floats.usage.total_tokens) == (num_tokens, num_tokens)
    by_float = torch.tensor([d.embedding for d in floats.data])
    torch.testing.assert_close(by_float.norm(dim=-1), torch.ones(len(TEXTS)), rtol=1e-5, atol=0)
    httpx.post(f"{server.url}/reset_prefix_cache")
    decoded = client.embeddings.create(model="st", input=TEXTS)  # the client asks for base64 and decodes it
    assert torch.equal(torch.tensor([d.embedding for d in decoded.data]), by_float)
    httpx.post(f"{server.url}/reset_prefix_cache")
    raw = httpx.post(f"{server.url}/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"}).json()
    by_base64 = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
    assert torch.equal(torch.from_numpy(np.stack(by_base64)), by_float)


def test_openai_client_embeds_token_ids(server):
    client = server.client()
    texts = client.embeddings.create(model="st", input=TEXTS[:2], encoding_format="float")
    one = client.embeddings.create(model="st", input=list(TEXTS[0].encode()), encoding_format="float")
    many = client.embeddings.create(model="st", input=[list(t.encode()) for t in TEXTS[:2]], encoding_format="float")
    texts, one, many = (torch.tensor([d.embedding for d in r.data]) for r in (texts, one, many))
    assert cosines(one, texts[:1]).min() >= 1 - 1e-6
    assert cosines(many, texts).min() >= 1 - 1e-6


@pytest.mark.parametrize("body, param", [
    ({"input": "hello", "dimensions": 16}, "dimensions"),  # not a Matryoshka model
    ({"input": []}, "input"),
    ({"input": "x" * 129}, "input"),  # over max_model_len
    ({"input": "hello", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [[1, 2], [300000]]}, None),  # out of the vocabulary
])
def test_bad_embedding_requests_get_400(server, body, param):
    response = httpx.post(f"{server.url}/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    server.wait_for_idle_engine(30)


def test_openai_client_gets_bad_request_for_dimensions(server):
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        server.client().embeddings.create(model="st", input="hello", dimensions=8)


def test_pooling_runner_answers_completions_with_400(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="runner='pooling'"):
        client.completions.create(model="st", prompt="hello", max_tokens=2)
    server.wait_for_idle_engine(30)
