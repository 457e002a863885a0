"""LoRA adapters served on one base model, with PEFT (over HF transformers) as the oracle: tiny random llama and qwen3
bases, adapters made by `get_peft_model` with random non-zero B matrices (different ranks and target modules, one
with rsLoRA's scale), saved with `save_pretrained`."""
import asyncio
import copy
from pathlib import Path

import gguf
import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch._dynamo.utils import counters

from conftest import assert_all_blocks_free
from inferno import LLM, LoRARequest, SamplingParams
from inferno.config import EngineConfig
from inferno.core.kv_blocks import hash_block
from inferno.engine.async_llm import AsyncLLM
from inferno.layers.lora import LoRAStack
from inferno.layers.quantization.linear import QuantizedLinear
from inferno.request import Request
from native_kernels import needs_kernels
from tiny_models import write_gguf, write_hf_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (base architecture, LoraConfig arguments)
ADAPTERS = {
    "all": ("llama", dict(r=8, lora_alpha=16, target_modules=ALL)),
    "attn_rslora": ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                                  use_rslora=True)),
    "mlp": ("llama", dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"])),
    "qwen3_all": ("qwen3", dict(r=8, lora_alpha=32, target_modules=ALL, use_rslora=True)),
}
PROMPT = [(7 * i + 3) % 256 for i in range(40)]  # two full blocks of 16 and a partial one
LLAMA_ARGS = dict(dtype="float32", kv_cache_dtype="float32", quantization=None, enforce_eager=True,
                  kv_cache_memory=16 << 20, enable_lora=True, max_lora_rank=16)
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)


def write_adapter(hf_model: torch.nn.Module, folder: Path, seed: int, **lora_args) -> torch.nn.Module:
    """A PEFT adapter on a copy of `hf_model`, B random (PEFT starts it at zero), saved in `folder`."""
    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(**lora_args))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    peft_model.save_pretrained(folder)
    return peft_model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """Base folders and HF models by architecture; adapters by name: (LoRARequest, PEFT model)."""
    root = tmp_path_factory.mktemp("lora")
    bases = {arch: (root / arch, write_hf_model(root / arch, arch)) for arch in ("llama", "qwen3")}
    adapters = {}
    for i, (name, (arch, lora_args)) in enumerate(ADAPTERS.items()):
        peft_model = write_adapter(bases[arch][1], root / name, seed=i, **lora_args)
        adapters[name] = (LoRARequest(name, i + 1, str(root / name)), peft_model)
    return {"root": root, "bases": bases, "adapters": adapters}


@pytest.fixture(scope="module")
def llama_llm(models) -> LLM:
    return LLM(str(models["bases"]["llama"][0]), max_loras=3, **LLAMA_ARGS)


def reference_prompt_logprobs(model: torch.nn.Module, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    return [logprobs[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]


def prompt_logprobs(llm: LLM, prompt: list[int], lora: LoRARequest | None) -> list[float]:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False, lora_request=lora)[0]
    return [position[token].logprob for position, token in zip(out.prompt_logprobs[1:], prompt[1:])]


def max_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@needs_kernels
@pytest.mark.parametrize("name", list(ADAPTERS))
def test_prompt_logprobs_match_peft(models, llama_llm, name):
    lora, peft_model = models["adapters"][name]
    arch = ADAPTERS[name][0]
    llm = llama_llm if arch == "llama" else LLM(str(models["bases"][arch][0]), **LLAMA_ARGS)
    got = prompt_logprobs(llm, PROMPT, lora)
    assert max_difference(got, reference_prompt_logprobs(peft_model, PROMPT)) < 1e-3
    # the adapter matters: far more than the tolerance
    assert max_difference(got, reference_prompt_logprobs(models["bases"][arch][1], PROMPT)) > 0.05
    assert_all_blocks_free(llm.llm_engine)


def completions(llm: LLM, loras: list[LoRARequest | None]) -> list:
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * len(loras), GREEDY, use_tqdm=False, lora_request=loras)
    return [o.outputs[0] for o in outputs]


def assert_same_completion(ref, out) -> None:
    assert out.token_ids == ref.token_ids
    assert max_difference([next(iter(p.values())).logprob for p in out.logprobs],
                          [next(iter(p.values())).logprob for p in ref.logprobs]) < 1e-4


@needs_kernels
def test_one_batch_mixing_base_and_three_adapters_equals_each_alone(models, llama_llm):
    loras = [None] + [models["adapters"][name][0] for name in ("all", "attn_rslora", "mlp")]
    alone = [completions(llama_llm, [lora])[0] for lora in loras]
    assert len({tuple(c.token_ids) for c in alone}) > 1  # the adapters change the greedy text
    # the same prompt four times: 160 rows, so the prefill runs per adapter segment, the decodes masked
    for ref, out in zip(alone, completions(llama_llm, loras)):
        assert_same_completion(ref, out)
    assert_all_blocks_free(llama_llm.llm_engine)


@needs_kernels
def test_more_adapters_than_slots_wait_their_turn(models, llama_llm):
    """One slot and one adapter kept in memory: the scheduler runs one adapter at a time, the others wait (and are
    read again from disk); every request gets what it gets with three slots."""
    loras = [models["adapters"][name][0] for name in ("all", "attn_rslora", "mlp")] + [None]
    one_slot = LLM(str(models["bases"]["llama"][0]), max_loras=1, max_cpu_loras=1, **LLAMA_ARGS)
    for ref, out in zip(completions(llama_llm, loras), completions(one_slot, loras)):
        assert_same_completion(ref, out)
    assert_all_blocks_free(one_slot.llm_engine)


@needs_kernels
def test_prefix_cache_is_keyed_by_adapter(models, llama_llm):
    engine = llama_llm.llm_engine
    lora = models["adapters"]["all"][0]
    engine.reset_prefix_cache()
    completions(llama_llm, [None])  # the base model's blocks of PROMPT are cached
    manager = engine.kv_cache_manager

    def cached_blocks(lora_request) -> int:
        request = Request("probe", PROMPT, GREEDY, set(), engine.max_model_len, lora_request=lora_request)
        return len(manager.get_computed_blocks(request) or ())

    assert cached_blocks(None) == 2 and cached_blocks(lora) == 0
    completions(llama_llm, [lora])
    assert cached_blocks(lora) == 2
    assert hash_block(None, PROMPT[:16], 1) != hash_block(None, PROMPT[:16], 2) != hash_block(None, PROMPT[:16])


@needs_kernels
def test_adapters_added_and_removed_while_requests_run(models, llama_llm):
    engine = llama_llm.llm_engine
    lora = models["adapters"]["mlp"][0]
    references = {lora: completions(llama_llm, [lora])[0], None: completions(llama_llm, [None])[0]}
    engine.remove_lora(lora.lora_int_id)
    assert lora.lora_int_id not in engine.list_loras()
    engine.add_request("base", {"prompt_token_ids": PROMPT}, GREEDY)
    engine.step()
    engine.step()
    assert engine.add_lora(lora) and not engine.add_lora(lora)
    engine.add_request("adapted", {"prompt_token_ids": PROMPT}, GREEDY, lora_request=lora)
    engine.step()
    assert engine.remove_lora(lora.lora_int_id) and not engine.remove_lora(lora.lora_int_id)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    assert_same_completion(references[None], outputs["base"])
    assert_same_completion(references[lora], outputs["adapted"])  # removed mid-request: it finished with it
    assert lora.lora_int_id not in engine.list_loras()
    assert_all_blocks_free(engine)


@needs_kernels
def test_adapter_on_a_gguf_base_run_as_stored(models, tmp_path):
    """A llama GGUF (Q/K rows in llama.cpp's order) whose projections are Q8_0 blocks run as stored: the adapter's
    output is within the quantization's error of PEFT on the float base."""
    hf_model = models["bases"]["llama"][1]
    path = write_gguf(tmp_path / "llama-q8_0.gguf", hf_model, "llama", projection_type=gguf.GGMLQuantizationType.Q8_0)
    llm = LLM(str(path), **{**LLAMA_ARGS, "quantization": "auto"})
    model = llm.llm_engine.model_runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    quantization_error = max_difference(prompt_logprobs(llm, PROMPT, None), reference_prompt_logprobs(hf_model, PROMPT))
    lora, peft_model = models["adapters"]["all"]
    reference = reference_prompt_logprobs(peft_model, PROMPT)
    assert max_difference(prompt_logprobs(llm, PROMPT, lora), reference) < 2 * quantization_error + 1e-3
    assert max_difference(reference, reference_prompt_logprobs(hf_model, PROMPT)) > 10 * (quantization_error + 1e-3)
    assert_all_blocks_free(llm.llm_engine)


@needs_kernels
def test_async_llm_adds_lists_and_removes_adapters(models, llama_llm):
    engine = llama_llm.llm_engine
    lora = models["adapters"]["attn_rslora"][0]
    reference = completions(llama_llm, [lora])[0].token_ids
    engine.remove_lora(lora.lora_int_id)

    async def scenario(async_llm: AsyncLLM) -> None:
        assert await async_llm.add_lora(lora) and not await async_llm.add_lora(lora)
        assert lora.lora_int_id in await async_llm.list_loras()
        with pytest.raises(ValueError, match="does not exist"):
            await async_llm.add_lora(LoRARequest("gone", 99, "/nonexistent/adapter"))
        outputs = async_llm.generate({"prompt_token_ids": PROMPT}, GREEDY, "async", lora_request=lora)
        assert [t async for output in outputs for t in output.outputs[0].token_ids] == reference
        assert await async_llm.remove_lora(lora.lora_int_id)
        assert lora.lora_int_id not in await async_llm.list_loras()

    async def main() -> None:
        async_llm = AsyncLLM(engine)
        async_llm.start()
        try:
            await scenario(async_llm)
        finally:
            await asyncio.to_thread(async_llm.shutdown)

    asyncio.run(main())
    assert_all_blocks_free(engine)


def bad_adapter(models, tmp_path, kind: str) -> str:
    """An adapter folder that does not fit the tiny llama base, of the `kind` given."""
    llama = models["bases"]["llama"][1]
    folder = tmp_path / kind
    if kind == "rank_too_high":
        write_adapter(llama, folder, 0, r=32, target_modules=["q_proj"])
    elif kind == "modules_to_save":
        write_adapter(llama, folder, 0, r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    elif kind == "embedding_target":
        write_adapter(llama, folder, 0, r=4, target_modules=["embed_tokens"])
    elif kind == "more_layers":
        write_adapter(write_hf_model(tmp_path / "deeper", "llama", num_hidden_layers=3), folder, 0, r=4,
                      target_modules=["v_proj"], layers_to_transform=[2])
    elif kind == "other_shape":
        write_adapter(models["bases"]["qwen3"][1], folder, 0, r=4, target_modules=["q_proj"])
    elif kind == "dora":
        write_adapter(llama, folder, 0, r=4, target_modules=["q_proj"], use_dora=True)
    elif kind == "no_weights":
        write_adapter(llama, folder, 0, r=4, target_modules=["q_proj"])
        (folder / "adapter_model.safetensors").unlink()
    elif kind == "missing":
        pass
    return str(folder)


BAD_ADAPTERS = {
    "rank_too_high": "rank 32, above max_lora_rank=16", "modules_to_save": "modules_to_save",
    "embedding_target": "not a LoRA A/B of a decoder projection", "more_layers": "model has 2 layers",
    "other_shape": "the base model needs A", "dora": "DoRA", "no_weights": "no adapter_model.safetensors",
    "missing": "does not exist",
}


@needs_kernels
@pytest.mark.parametrize("kind", list(BAD_ADAPTERS))
def test_bad_adapters_are_refused_with_a_clear_error(models, llama_llm, tmp_path, kind):
    engine = llama_llm.llm_engine
    before = engine.list_loras()
    lora = LoRARequest(kind, 100, bad_adapter(models, tmp_path, kind))
    with pytest.raises(ValueError, match=BAD_ADAPTERS[kind]):
        engine.add_request("bad", {"prompt_token_ids": PROMPT}, GREEDY, lora_request=lora)
    with pytest.raises(ValueError, match=BAD_ADAPTERS[kind]):
        engine.add_lora(lora)
    assert engine.list_loras() == before
    assert_all_blocks_free(engine)
    assert completions(llama_llm, [None])[0].token_ids  # the engine serves on


@needs_kernels
def test_misuse_is_refused_with_a_clear_error(models, llama_llm):
    lora = models["adapters"]["all"][0]
    llama_llm.add_lora(lora)
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'all'"):
        llama_llm.add_lora(LoRARequest("other", 1, models["adapters"]["mlp"][0].lora_path))
    with pytest.raises(ValueError, match="got 2 prompts but 1 LoRA requests"):
        llama_llm.generate(["a", "b"], GREEDY, lora_request=[lora])
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, lora.lora_path)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
    no_lora = LLM(str(models["bases"]["llama"][0]), **{**LLAMA_ARGS, "enable_lora": False})
    with pytest.raises(ValueError, match="enable_lora=True"):
        no_lora.generate("a", GREEDY, lora_request=lora)
    assert_all_blocks_free(no_lora.llm_engine)


@needs_kernels
def test_compiled_decode_runs_adapters_without_recompiling(models, llama_llm, monkeypatch):
    """Decode steps with adapters run a graph of their own, compiled by the warm-up; other adapters, other slots and
    other batch sizes recompile nothing (the stacks are buffers written in place, the slots an input)."""
    compiled = LLM(str(models["bases"]["llama"][0]), max_loras=2,
                   **{**LLAMA_ARGS, "enforce_eager": False, "enable_prefix_caching": False})
    assert compiled.llm_engine.model_runner.wait_for_warm_up()
    adapters = [models["adapters"][name][0] for name in ("all", "attn_rslora", "mlp")]
    batches = ([adapters[0]], [None, adapters[0]], adapters[1:], [adapters[2], None, adapters[1]])
    references = [completions(llama_llm, loras) for loras in batches]
    graphs = counters["stats"]["unique_graphs"]
    eager_products = []  # the stacks' Python forward runs only in eager steps
    forward = LoRAStack.forward

    def counted_forward(self, x, mapping):
        eager_products.append(x.shape[0])
        return forward(self, x, mapping)

    monkeypatch.setattr(LoRAStack, "forward", counted_forward)
    for loras, reference in zip(batches, references):
        for ref, out in zip(reference, completions(compiled, loras)):
            assert_same_completion(ref, out)
    assert counters["stats"]["unique_graphs"] == graphs
    # per batch one eager step, its prefill, in 2 layers x 4 stacks; every decode step ran compiled
    assert len(eager_products) == len(batches) * 8
    assert_all_blocks_free(compiled.llm_engine)
