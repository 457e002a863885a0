"""EAGLE heads: the folder layouts vLLM and SGLang load (the head's logits against Hugging Face's decoder layer),
speculation with them (the output is the target's), and a head trained here (`inferno train-draft-heads --method
eagle`) whose drafts a tiny model accepts."""
import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from conftest import FLOAT32, assert_all_blocks_free
from inferno import LLM, SamplingParams
from inferno.core.head_training import TrainingSequence
from inferno.entrypoints.cli import main
from inferno.entrypoints.train_draft_heads import read_sequences, write_sequences
from inferno.layers import packed_linear
from inferno.layers.attention import select_attention_backend
from inferno.loader.eagle_folder import read_eagle_folder
from inferno.loader.safetensors import read_config
from inferno.model.eagle import EagleHead
from inferno.worker.input_batch import TokenChunk, lay_out_chunks
from inferno.worker.model_runner import kv_bytes_per_block
from inferno.loader.eagle_folder import head_layer_config
from inferno.worker.spec_decode import eagle_training, head_training
from inferno.worker.spec_decode.eagle import build_eagle_head, load_eagle_head
from inferno.worker.spec_decode.head_training import record_hidden_states
from test_spec_decode import MAX_TOKENS, greedy, prompts, reference, token_ids  # noqa: F401 (fixtures)
from test_spec_heads import TOKEN_TREE, cycle_model, write_training_prompts  # noqa: F401 (fixture)

K = 3


def eagle(folder, **options) -> dict:
    return {"method": "eagle", "model": str(folder), "num_speculative_tokens": K, "disable_by_batch_size": None,
            "draft_acceptance_threshold": 0, **options}


def hf_layer(hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-6,
                         max_position_embeddings=256)
    config._attn_implementation = "eager"
    layer = LlamaDecoderLayer(config, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return config, layer


def random_head_tensors(layer, hidden: int, vocab: int, fc_bias: bool, lm_head: bool) -> dict[str, torch.Tensor]:
    tensors = {f"layers.0.{n}": p.detach().clone() for n, p in layer.named_parameters() if "input_layernorm" not in n}
    tensors["fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.2
    if fc_bias:
        tensors["fc.bias"] = torch.randn(hidden) * 0.2
    if lm_head:
        tensors["lm_head.weight"] = torch.randn(vocab, hidden)
    return tensors


def reference_logits(config, layer, tensors, embeds, features, lm_head) -> torch.Tensor:
    """EAGLE-1 in plain torch on HF's decoder layer: LM head(layer(fc([embed; feature]))), no input norm."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    x = torch.cat([embeds, features], dim=-1) @ tensors["fc.weight"].t() + tensors.get("fc.bias", 0)
    layer.input_layernorm = torch.nn.Identity()
    t = x.shape[0]
    positions = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    out = layer(x[None], attention_mask=mask, position_ids=positions,
                position_embeddings=LlamaRotaryEmbedding(config)(x[None], positions))
    out = out[0] if isinstance(out, tuple) else out
    return out[0] @ tensors.get("lm_head.weight", lm_head).t()


def paged_features(head: EagleHead, embeds, features) -> torch.Tensor:
    """The head over one sequence on a paged KV cache (the proposer's path): its features at every position."""
    attn = head.attention
    attn.backend = select_attention_backend("torch", torch.device("cpu"), 16, attn.num_kv_heads, 4,
                                            head.config.head_dim, None, False, None)
    attn.k_cache = torch.zeros(attn.num_kv_heads, 4, 16, head.config.head_dim, dtype=head.fc.weight.dtype)
    attn.v_cache = torch.zeros_like(attn.k_cache)
    mb = lay_out_chunks([TokenChunk(list(range(len(embeds))), 0, [0, 1, 2, 3])], 16)
    meta = attn.backend.build_metadata(mb.slot_mapping, mb.decodes, mb.prefills)
    return head(embeds, features, torch.tensor(mb.positions), meta)


@pytest.fixture(scope="module")
def target_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    from transformers import LlamaConfig
    LlamaConfig(vocab_size=90, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=256).save_pretrained(folder)
    return read_config(folder)


def write_layout(folder, layout: str, tensors: dict[str, torch.Tensor], config) -> None:
    """vLLM's (model.safetensors, no prefix), SGLang's / the reference's (pytorch_model.bin, `model.` prefix and
    the embedding stored beside)."""
    from safetensors.torch import save_file
    folder.mkdir()
    architecture = {"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}[layout]
    config_json = config.to_dict() | {"architectures": [architecture]}
    (folder / "config.json").write_text(json.dumps(config_json))
    if layout == "vllm":
        save_file({n: t.contiguous() for n, t in tensors.items()}, folder / "model.safetensors")
    else:
        named = {(n if n.startswith("lm_head") else f"model.{n}"): t for n, t in tensors.items()}
        torch.save(named | {"model.embed_tokens.weight": torch.randn(config.vocab_size, config.hidden_size)},
                   folder / "pytorch_model.bin")


def with_draft_vocabulary(tensors: dict[str, torch.Tensor], target_ids: list[int], config) -> None:
    """An own LM head over `target_ids` (ascending) with its `d2t`, as vLLM's and SGLang's EAGLE-3 folders store it."""
    ids = torch.tensor(target_ids)
    tensors["lm_head.weight"] = torch.randn(len(ids), config.hidden_size)
    tensors["d2t"] = ids - torch.arange(len(ids))
    config.draft_vocab_size = len(ids)


DRAFT_IDS = [0, 3, 4, 10, 11, 12, 40, 41, 77, 89]  # of the target's 90


@pytest.mark.parametrize("layout, fc_bias, own_lm_head", [("vllm", False, False), ("sglang", True, False),
                                                          ("vllm", True, True), ("vllm", True, "draft vocabulary")])
def test_folder_layouts_load_a_head_whose_logits_match_the_reference(tmp_path, target_config, layout, fc_bias,
                                                                     own_lm_head):
    torch.manual_seed(0)
    config, layer = hf_layer(32, 48, 4, 2, 90)
    tensors = random_head_tensors(layer, 32, 90, fc_bias, own_lm_head is True)
    if own_lm_head == "draft vocabulary":
        with_draft_vocabulary(tensors, DRAFT_IDS, config)
    write_layout(tmp_path / layout, layout, tensors, config)
    head = build_eagle_head(read_eagle_folder(tmp_path / layout), target_config)
    embeds, features, target_lm_head = torch.randn(7, 32), torch.randn(7, 32), torch.randn(90, 32)
    with torch.no_grad():
        expected = reference_logits(config, layer, tensors, embeds, features, target_lm_head)
        if own_lm_head == "draft vocabulary":  # the draft vocabulary's logits at their target ids, -inf elsewhere
            expected = torch.full((7, 90), float("-inf")).index_copy(1, torch.tensor(DRAFT_IDS), expected)
        lm_head = torch.nn.Linear(32, 90, bias=False)
        lm_head.weight.copy_(target_lm_head)
        dense = head.logits(head.forward_dense(embeds[None], features[None])[0], lm_head)
        paged = head.logits(paged_features(head, embeds, features), lm_head)
    torch.testing.assert_close(dense, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(paged, expected, rtol=1e-4, atol=1e-4)


def test_unrolled_training_steps_see_what_the_proposers_draft_passes_see(tmp_path, target_config):
    """Training-time test: unrolled step j at position p is draft j of a proposal rooted at p - j + 1 on the paged
    KV cache: the catch-up over the target's features up to there, then one pass per draft, each over the previous
    step's output one position back."""
    torch.manual_seed(0)
    config, layer = hf_layer(32, 48, 4, 2, 90)
    write_layout(tmp_path / "vllm", "vllm", random_head_tensors(layer, 32, 90, True, False), config)
    head = build_eagle_head(read_eagle_folder(tmp_path / "vllm"), target_config)
    embeds, features = torch.randn(2, 9, 32), torch.randn(2, 9, 32)
    with torch.no_grad():
        steps = head.forward_steps(embeds, features, 3)
        torch.testing.assert_close(steps[0], head.forward_dense(embeds, features))
        for b, p, j in ((b, p, j) for b in range(2) for p in range(2, 9) for j in (2, 3)):
            drafted = [steps[i - 2][b, p - j + i - 1] for i in range(2, j + 1)]  # draft i reads step i - 1's output
            paged = paged_features(head, embeds[b, :p + 1], torch.cat([features[b, :p - j + 2], torch.stack(drafted)]))
            torch.testing.assert_close(steps[j - 1][b, p], paged[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not packed_linear.packable(torch.zeros(2, 2, dtype=torch.bfloat16)),
                    reason="oneDNN has no bfloat16 inner product on this CPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_head_drafts_in_bfloat16_on_packed_weights_with_the_bits_of_plain_ones(tmp_path, target_config, dtype):
    """A float32 model's head runs in bfloat16 too, taking and giving float32 features."""
    torch.manual_seed(0)
    config, layer = hf_layer(32, 48, 4, 2, 90)
    tensors = random_head_tensors(layer, 32, 90, True, False)
    with_draft_vocabulary(tensors, DRAFT_IDS, config)
    write_layout(tmp_path / "head", "vllm", tensors, config)
    head = load_eagle_head(str(tmp_path / "head"), target_config, dtype, torch.device("cpu"))
    matrices = [p for p in head.parameters() if p.dim() == 2]
    assert all(p.dtype == torch.bfloat16 for p in head.parameters())
    assert len(matrices) == 6 and all(packed_linear.is_packed(w) for w in matrices)  # fc, 4 in the layer, LM head
    plain = build_eagle_head(read_eagle_folder(tmp_path / "head"), target_config).bfloat16()
    assert not any(packed_linear.is_packed(p) for p in plain.parameters())
    embeds, features = torch.randn(7, 32, dtype=dtype), torch.randn(7, 32, dtype=dtype)
    target_lm_head = torch.nn.Linear(32, 90, bias=False).to(dtype)
    with torch.inference_mode():
        out = paged_features(head, embeds, features)
        packed = head.logits(out, target_lm_head)
        expected = plain.logits(paged_features(plain, embeds.bfloat16(), features.bfloat16()), target_lm_head)
    assert out.dtype == dtype
    assert torch.equal(packed, expected)
    assert torch.isfinite(packed[:, DRAFT_IDS]).all() and packed.isinf().sum() == 7 * (90 - len(DRAFT_IDS))


def test_bad_folders_are_refused_with_a_clear_error(tmp_path, target_config):
    with pytest.raises(ValueError, match="no config.json"):
        read_eagle_folder(tmp_path)
    torch.manual_seed(0)
    config, layer = hf_layer(32, 48, 4, 2, 90)
    tensors = random_head_tensors(layer, 32, 90, True, False)
    write_layout(tmp_path / "good", "vllm", tensors, config)
    good = json.loads((tmp_path / "good" / "config.json").read_text())

    def folder(name: str, config_json: dict, weights: dict) -> str:
        from safetensors.torch import save_file
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config_json))
        save_file({n: t.contiguous() for n, t in weights.items()}, tmp_path / name / "model.safetensors")
        return tmp_path / name

    with pytest.raises(ValueError, match="EAGLE-3"):
        read_eagle_folder(folder("eagle3", good | {"architectures": ["LlamaForCausalLMEagle3"]}, tensors))
    with pytest.raises(ValueError, match="no fc.weight"):
        read_eagle_folder(folder("medusa", good, {n: t for n, t in tensors.items() if n != "fc.weight"}))
    with pytest.raises(ValueError, match="one decoder layer"):
        read_eagle_folder(folder("deep", good, tensors | {"layers.1.post_attention_layernorm.weight": torch.ones(32)}))
    with pytest.raises(ValueError, match="vocabulary of 91 tokens"):
        build_eagle_head(read_eagle_folder(folder("vocab", good | {"vocab_size": 91}, tensors)), target_config)
    for name, ids, rows, match in [("d2t_range", [0, 1, 90], 3, "outside the target's 90 tokens"),
                                   ("d2t_twice", [0, 1, 1], 3, "twice"),
                                   ("d2t_rows", [0, 1, 2], 4, "LM head and a d2t of as many rows")]:
        draft = tensors | {"d2t": torch.tensor(ids) - torch.arange(3), "lm_head.weight": torch.randn(rows, 32)}
        with pytest.raises(ValueError, match=match):
            build_eagle_head(read_eagle_folder(folder(name, good | {"draft_vocab_size": 3}, draft)), target_config)
    config64, layer64 = hf_layer(64, 48, 4, 2, 90)
    with pytest.raises(ValueError, match="hidden size 64"):
        build_eagle_head(read_eagle_folder(folder("wide", config64.to_dict(),
                                                  random_head_tensors(layer64, 64, 90, True, False))), target_config)
    missing = {n: t for n, t in tensors.items() if "o_proj" not in n}
    with pytest.raises(ValueError, match="missing tensors"):
        build_eagle_head(read_eagle_folder(folder("missing", good, missing)), target_config)
    with pytest.raises(ValueError, match="needs 'model'"):
        LLM(speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tensor_parallel_size=2, speculative_config=eagle(tmp_path / "good"))


# speculation on the default model with a random head (its drafts are accepted now and then)

def write_smol_head(llm, folder: Path, draft_vocabulary: bool) -> str:
    """A random head for the default model ending in its LM head, or in its own over a draft vocabulary of 4096
    random tokens."""
    config = llm.llm_engine.model_config
    torch.manual_seed(0)
    hf_config, layer = hf_layer(config.hidden_size, 256, config.num_attention_heads, config.num_key_value_heads,
                                config.vocab_size)
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(0.1)
    tensors = random_head_tensors(layer, config.hidden_size, config.vocab_size, True, False)
    if draft_vocabulary:
        with_draft_vocabulary(tensors, sorted(torch.randperm(config.vocab_size)[:4096].tolist()), hf_config)
    write_layout(folder / "head", "vllm", tensors, hf_config)
    return str(folder / "head")


@pytest.fixture(scope="module")
def smol_head_whole(llm, tmp_path_factory) -> str:
    return write_smol_head(llm, tmp_path_factory.mktemp("smol_eagle"), draft_vocabulary=False)


@pytest.fixture(scope="module")
def smol_head_draft(llm, tmp_path_factory) -> str:
    return write_smol_head(llm, tmp_path_factory.mktemp("smol_eagle_draft"), draft_vocabulary=True)


@pytest.fixture(scope="module", params=["smol_head_whole", "smol_head_draft"],
                ids=["target LM head", "draft vocabulary"])
def smol_head(request) -> str:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def eagle_llm(model_path, smol_head) -> LLM:
    return LLM(model_path, kv_cache_memory=64 << 20, speculative_config=eagle(smol_head), **FLOAT32)


def test_greedy_with_an_eagle_head_matches_plain_decoding_alone_and_in_batch(eagle_llm, prompts, reference):
    stats = eagle_llm.llm_engine.spec_decoding_stats
    assert token_ids(eagle_llm, prompts[:1], greedy()) == reference[:1]
    assert token_ids(eagle_llm, prompts, greedy()) == reference
    assert stats.num_draft_tokens_per_pos[K - 1] > 0  # every depth proposed
    assert_all_blocks_free(eagle_llm.llm_engine)


def test_eagle_with_chunked_prefill_and_preemption_matches_plain_decoding(llm, model_path, smol_head, prompts,
                                                                          reference):
    """Prompts cut into chunks of 32 tokens, and 10 KV blocks (11 target blocks' bytes, shared with the head's
    cache): the prompts fit, their outputs do not."""
    block_bytes = kv_bytes_per_block(llm.llm_engine.model_config, 16, llm.llm_engine.config.kv_cache_dtype)
    cramped = LLM(model_path, kv_cache_memory=11 * block_bytes, max_num_batched_tokens=32,
                  speculative_config=eagle(smol_head), **FLOAT32)
    assert token_ids(cramped, prompts, greedy()) == reference
    assert cramped.llm_engine.scheduler.num_preemptions > 0


def test_seeded_sampling_with_eagle_is_reproducible_in_any_batch(eagle_llm, prompts):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = token_ids(eagle_llm, prompts[:1], seeded)[0]
    mixed = token_ids(eagle_llm, prompts, [seeded, SamplingParams(temperature=1.0, max_tokens=12), greedy()])[0]
    assert mixed == alone


# a head trained here, on a model whose continuations it can learn

TRAINING = ["--method", "eagle", "--max-tokens", "24", "--epochs", "6", "--learning-rate", "0.003", "--batch-size",
            "256", "--held-out-fraction", "0.2", "--kv-cache-memory", str(32 << 20)]


def train_head(model: str, output: Path, *options: str) -> float:
    """`inferno train-draft-heads` with TRAINING and `options`; the held-out top-1 accuracy it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["train-draft-heads", model, "--output", str(output), *TRAINING, *options])
    return float(printed.getvalue().split("per draft depth:")[1].split()[0])


@pytest.fixture(scope="module")
def trained_head(cycle_model, tmp_path_factory) -> tuple[str, float, Path]:
    """The head's folder, its held-out accuracy, and the training sequences it saved."""
    prompts = write_training_prompts(tmp_path_factory.mktemp("eagle_prompts"))
    output = tmp_path_factory.mktemp("eagle_trained") / "head"
    sequences = output.parent / "sequences.jsonl"
    accuracy = train_head(cycle_model[0], output, "--prompts", prompts, "--save-sequences", str(sequences))
    return str(output), accuracy, sequences


def test_trained_head_learns_the_continuations(trained_head, cycle_model):
    """Held out, the head's top-1 is the target's own (the next-but-one token) at 90% of the continuation positions
    or more; it drafts over the 32768 most frequent tokens of its training sequences (the default)."""
    folder, accuracy, sequences = trained_head
    assert accuracy >= 0.9, accuracy
    config = json.loads((Path(folder) / "config.json").read_text())
    assert config["architectures"] == ["EagleLlamaForCausalLM"] and config["draft_vocab_size"] == 32768
    head = read_eagle_folder(folder)
    seen = {t for s in read_sequences(sequences, 1 << 20) for t in s.token_ids}
    assert head.own_lm_head and len(seen) < 32768 and seen <= set(head.draft_to_target.tolist())
    assert set(cycle_model[1]) <= seen


def test_a_head_over_the_whole_vocabulary_and_one_learning_from_texts(cycle_model, trained_head, tmp_path):
    """--draft-vocab-size 0: the head ends in the target's LM head. --texts: plain texts (here walks along the
    cycle, written out), no generation: the head learns the target's predictions at every position of them."""
    folder, cycle = cycle_model
    whole = train_head(folder, tmp_path / "whole", "--sequences", str(trained_head[2]), "--draft-vocab-size", "0")
    assert whole >= 0.9, whole
    assert not read_eagle_folder(tmp_path / "whole").own_lm_head
    tokenizer = LLM(folder, kv_cache_memory=16 << 20, **FLOAT32).get_tokenizer()
    walks = [tokenizer.decode([cycle[(start + i) % len(cycle)] for i in range(40)]) for start in range(len(cycle))]
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": walk}) + "\n" for walk in walks))
    from_texts = train_head(folder, tmp_path / "texts", "--texts", str(texts), "--text-tokens", "24", "--epochs", "24")
    assert from_texts >= 0.8, from_texts


def test_training_again_on_the_saved_sequences_gives_the_same_head(cycle_model, trained_head, tmp_path):
    """--sequences skips the generation: the same sequences and seed train the same weights."""
    folder, accuracy, sequences = trained_head
    saved = read_sequences(sequences, 1 << 20)  # one per prompt, each with its continuation
    assert len(saved) == len(Path(write_training_prompts(tmp_path)).read_text().splitlines())
    assert all(len(s.token_ids) > s.num_prompt_tokens for s in saved)
    assert train_head(cycle_model[0], tmp_path / "again", "--sequences", str(sequences)) == accuracy
    again, first = read_eagle_folder(tmp_path / "again"), read_eagle_folder(folder)
    assert again.tensors.keys() == first.tensors.keys()
    assert all(torch.equal(again.tensors[name], first.tensors[name]) for name in first.tensors)


def test_unrolled_training_makes_a_head_better_at_drafting_on_from_its_own_output(model_path, tmp_path):
    """On SmolLM2's own continuations of story prompts, held out: a head trained teacher-forced alone (--unroll-steps
    1) rarely gets the second draft right when it reads its own output (0.054 when written); one trained on 3
    unrolled draft steps does more than twice as often (0.138), for a little of its first draft (0.324 -> 0.265)."""
    words = "cat mat river house fish bird tree road lamp door".split()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Once upon a time, a {w} and a {v}"}) + "\n"
                               for w in words for v in words[:4]))
    options = ["--method", "eagle", "--max-tokens", "48", "--epochs", "4", "--learning-rate", "0.001", "--batch-size",
               "512", "--held-out-fraction", "0.2", "--draft-vocab-size", "4096", "--kv-cache-memory", str(64 << 20)]
    sequences = tmp_path / "sequences.jsonl"
    accuracy = {}
    for steps, data in (("1", ["--prompts", str(prompts), "--save-sequences", str(sequences)]),
                        ("3", ["--sequences", str(sequences)])):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            main(["train-draft-heads", model_path, "--output", str(tmp_path / steps), *options, *data,
                  "--unroll-steps", steps])
        accuracy[steps] = [float(a) for a in printed.getvalue().split("per draft depth:")[1].split()]
        saved = json.loads((tmp_path / steps / "config.json").read_text())["inferno_training"]
        assert saved["unroll_steps"] == int(steps)
        assert saved["held_out_top1_per_depth"] == pytest.approx(accuracy[steps], abs=6e-4)  # printed rounded
    teacher_forced, unrolled = accuracy["1"], accuracy["3"]
    assert len(unrolled) == 3 and teacher_forced[1] < 0.07 and unrolled[1] >= 0.11, accuracy
    assert unrolled[0] >= teacher_forced[0] - 0.08, accuracy


def test_a_head_initialised_from_the_target_is_its_last_decoder_layer(tmp_path):
    """On inputs of unit RMS (where the layer's input norm only scales by its weight, which the head folds into its
    q/k/v projection), with the fc passing the feature through: HF's last decoder layer of the target."""
    from tiny_models import write_hf_model
    hf = write_hf_model(tmp_path, "llama")
    runner = LLM(str(tmp_path), kv_cache_memory=4 << 20, **FLOAT32).llm_engine.executor.model_runner
    head = eagle_training.new_head(head_layer_config(runner.config), None, None, 0)
    eagle_training.init_from_target(head, runner)
    x = torch.randn(1, 9, 64)
    x = x / x.square().mean(-1, keepdim=True).sqrt()
    positions = torch.arange(9)[None]
    mask = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected = hf.model.layers[-1](x, attention_mask=mask, position_ids=positions,
                                       position_embeddings=hf.model.rotary_emb(x, positions))
        out = head.forward_dense(torch.randn(1, 9, 64), x)
    expected = expected[0] if isinstance(expected, tuple) else expected
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_features_recorded_in_batched_prefills_are_those_of_each_sequence_alone(llm, monkeypatch):
    llm.llm_engine.reset_prefix_cache()  # recording writes KV blocks from 0 on: no cached prefix may stay there
    runner = llm.llm_engine.executor.model_runner
    sequences = [TrainingSequence(list(range(10 + 7 * i, 10 + 7 * i + n)), 1) for i, n in enumerate([40, 5, 33, 70])]
    batched = record_hidden_states(runner, sequences)
    monkeypatch.setattr(head_training, "PREFILL_BATCH_TOKENS", 1)  # each sequence alone
    alone = record_hidden_states(runner, sequences)
    assert [len(h) for h in batched] == [40, 5, 33, 70]
    for b, a in zip(batched, alone):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_training_batches_are_made_from_one_float16_copy_of_the_features(llm):
    """The recorded features stay float16, one copy per sequence (a sixth of the float32 inputs, targets and their
    normalised copies once kept); a batch holds per sequence the target's embeddings of the tokens at p + 1 and its
    features at p and p + 1, in float32, divided by the scales, padded after the shorter sequence."""
    llm.llm_engine.reset_prefix_cache()
    runner = llm.llm_engine.executor.model_runner
    sequences = [TrainingSequence(list(range(10, 50)), 5), TrainingSequence(list(range(60, 80)), 3)]
    features = record_hidden_states(runner, sequences)
    assert [f.dtype for f in features] == [head_training.FEATURE_DTYPE] * 2 == [torch.float16] * 2
    examples = [eagle_training.Example.of(f, s) for f, s in zip(features, sequences)]
    data = eagle_training.TrainingData(examples, eagle_training.embedder(runner), 2.0, 4.0)
    embeds, at_p, kinds, at_next = next(data.batches(2))
    assert embeds.shape == at_p.shape == at_next.shape == (2, 39, runner.config.hidden_size)
    assert embeds.dtype == at_p.dtype == at_next.dtype == torch.float32
    with torch.inference_mode():
        expected = runner.model.embed_tokens(torch.arange(61, 80)).float()
    assert torch.equal(embeds[1, :19], expected / 2.0) and not embeds[1, 19:].any()
    assert torch.equal(at_p[0], features[0][:-1].float() / 4.0)
    assert torch.equal(at_next[1, :19], features[1][1:].float() / 4.0) and not at_next[1, 19:].any()
    assert kinds[0, :3].eq(eagle_training.PROMPT).all() and kinds[0, 3:].eq(eagle_training.CONTINUATION).all()
    assert kinds[1, 19:].eq(eagle_training.PADDING).all()


def test_saved_sequences_with_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    path = tmp_path / "sequences.jsonl"
    write_sequences(path, [TrainingSequence([1, 2, 3], 1)])
    assert read_sequences(path, 4) == [TrainingSequence([1, 2, 3], 1)]
    with pytest.raises(ValueError, match="outside the model's vocabulary of 3"):
        read_sequences(path, 3)
    path.write_text('{"token_ids": [1, 2]}\n')
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        read_sequences(path, 4)


def test_trained_head_drafts_are_accepted_and_output_is_unchanged(cycle_model, trained_head):
    folder, cycle = cycle_model
    plain = LLM(folder, kv_cache_memory=16 << 20, **FLOAT32)
    spec = LLM(folder, kv_cache_memory=16 << 20, speculative_config=eagle(trained_head[0]), **FLOAT32)
    prompts = [[5, 6, 7, 8], [cycle[3]], [100, cycle[7], 200]]
    params = greedy(max_tokens=24)
    expected = token_ids(plain, prompts, params)
    assert all(t in cycle for out in expected for t in out)
    assert token_ids(spec, prompts, params) == expected
    stats = spec.llm_engine.spec_decoding_stats
    assert min(stats.acceptance_rate_per_pos) >= 0.75, stats.acceptance_rate_per_pos
    assert stats.mean_acceptance_length > 3


@pytest.mark.parametrize("tree", [{"speculative_token_tree": TOKEN_TREE},
                                  {"speculative_token_tree": "dynamic", "eagle_topk": 2, "num_draft_tokens": 6}],
                         ids=["static", "dynamic"])
def test_trained_head_drafting_a_tree_keeps_the_output_and_accepts_whole_branches(cycle_model, trained_head, tree):
    folder, cycle = cycle_model
    plain = LLM(folder, kv_cache_memory=16 << 20, **FLOAT32)
    spec = LLM(folder, kv_cache_memory=16 << 20, **FLOAT32, speculative_config=eagle(trained_head[0], **tree))
    prompts, params = [[5, 6, 7, 8], [100, cycle[7], 200]], greedy(max_tokens=24)
    assert token_ids(spec, prompts, params) == token_ids(plain, prompts, params)
    assert spec.llm_engine.spec_decoding_stats.mean_acceptance_length > 3
