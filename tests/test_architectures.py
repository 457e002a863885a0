"""Every architecture matches HF transformers on a tiny random model (HF folder, and GGUF where the format defines
the architecture): prefill logits within 1e-3 in float32, and greedy tokens up to HF's first near-tie, alone and
in a batch that is chunked and preempted."""
import random

import pytest
import torch

from conftest import FLOAT32, assert_all_blocks_free, is_near_tie, prefill_logits
from inferno import LLM, SamplingParams
from inferno.worker.model_runner import kv_bytes_per_block
from tiny_models import MOE_ARCHITECTURES, write_gguf, write_hf_model

LOGIT_TOLERANCE = 1e-3
GREEDY_LOGIT_TOLERANCE = 0.01  # HF's cached decode sums in another order
MAX_TOKENS = 8


def prompts(lengths: list[int]) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def hf_greedy(hf_model, ids: list[int]) -> tuple[list[int], list[float]]:
    input_ids = torch.tensor([ids])  # an explicit mask: HF would mask out prompt tokens equal to pad_token_id
    out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS,
                            do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(ids):].tolist(), gaps


def assert_matches_hf(hf_model, llm: LLM, long_prompt: list[int], batch: list[list[int]], **options) -> None:
    """Prefill logits of `long_prompt`; greedy tokens of `batch`, alone and together through a small cache with
    small chunks (preempting); `options`: the engine options of `llm` beyond the float32 model."""
    with torch.inference_mode():
        ref = hf_model(torch.tensor([long_prompt])).logits[0]
    ours = prefill_logits(llm.llm_engine, long_prompt).cpu()  # from a GPU where the engine runs on one
    assert (ours - ref).abs().max().item() < LOGIT_TOLERANCE
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    refs = [hf_greedy(hf_model, ids) for ids in batch]
    alone = [llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids for ids in batch]
    engine = llm.llm_engine
    block_bytes = kv_bytes_per_block(engine.model_config, 16, engine.config.kv_cache_dtype)
    longest = max(len(ids) for ids in batch) + MAX_TOKENS
    cramped = LLM(engine.model_path, **FLOAT32, max_num_batched_tokens=32,
                  kv_cache_memory=(longest // 16 + 2) * block_bytes, **options)
    together = [out.outputs[0].token_ids for out in cramped.generate(
        [{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)]
    assert cramped.llm_engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(cramped.llm_engine)
    compared = 0
    for (ref_tokens, gaps), a, t in zip(refs, alone, together):
        clear = next((i for i, gap in enumerate(gaps) if is_near_tie(gap, GREEDY_LOGIT_TOLERANCE)), len(gaps))
        assert a[:clear] == ref_tokens[:clear] and t[:clear] == ref_tokens[:clear], (a, t, ref_tokens)
        compared += clear
    assert compared >= MAX_TOKENS, "HF's near-ties leave too few tokens to compare; pick other prompts"


# what llama.cpp assumes where the GGUF metadata says nothing: Gemma's query scalar is the head size, and Gemma 3
# has one global layer in six
GGUF_CONVENTIONS = {"gemma2": dict(query_pre_attn_scalar=16),
                    "gemma3": dict(query_pre_attn_scalar=16, layer_types=["sliding_attention"] * 2)}


def tiny_llm(path) -> LLM:
    return LLM(model=str(path), **FLOAT32, kv_cache_memory=8 << 20)


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_hf_folder_matches_hf(tmp_path, arch):
    hf_model = write_hf_model(tmp_path, arch)
    assert_matches_hf(hf_model, tiny_llm(tmp_path), prompts([200])[0], prompts([5, 40, 70, 23]))


def test_phi3_fused_checkpoint_and_longrope_match_hf(tmp_path):
    """Fused qkv_proj and gate_up_proj; LongRoPE with the long factors on sequences beyond the original 64
    positions (HF's choice for them too), and the short ones for a model whose context is the original's."""
    hf_model = write_hf_model(tmp_path / "long", "phi3")
    assert_matches_hf(hf_model, tiny_llm(tmp_path / "long"), prompts([200])[0], prompts([65, 80, 100, 70]))
    path = write_gguf(tmp_path / "long" / "model.gguf", hf_model, "phi3")
    assert_matches_hf(hf_model, tiny_llm(path), prompts([200])[0], prompts([65, 80, 100, 70]))
    hf_model = write_hf_model(tmp_path / "short", "phi3", max_position_embeddings=64)
    ids = prompts([60])[0]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert (prefill_logits(tiny_llm(tmp_path / "short").llm_engine, ids) - ref).abs().max().item() < LOGIT_TOLERANCE


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_gguf_matches_hf(tmp_path, arch):
    hf_model = write_hf_model(tmp_path, arch, **GGUF_CONVENTIONS.get(arch, {}))
    path = write_gguf(tmp_path / "model.gguf", hf_model, MOE_ARCHITECTURES.get(arch, arch))
    assert_matches_hf(hf_model, tiny_llm(path), prompts([200])[0], prompts([5, 40, 70, 23]))


# head size 16: decodes in the native kernel; 24: on the PyTorch path
@pytest.mark.parametrize("head_dim", [16, 24])
def test_sliding_window_prompt_of_several_windows_matches_hf(tmp_path, head_dim):
    hf_model = write_hf_model(tmp_path, "mistral", head_dim=head_dim)
    llm = tiny_llm(tmp_path)
    assert (llm.llm_engine.model_runner.attention.name == "cpu_kernel") == (head_dim == 16)
    assert_matches_hf(hf_model, llm, prompts([200])[0], prompts([5, 40, 70, 23]))


def test_sliding_window_frees_blocks_behind_the_window(tmp_path):
    """A 300-token sequence of a window-32 model holds about the window's blocks, whatever its length; the
    prefix cache still serves its blocks."""
    write_hf_model(tmp_path, "mistral")
    llm = LLM(model=str(tmp_path), **FLOAT32, kv_cache_memory=8 << 20,
              max_num_batched_tokens=32)
    engine = llm.llm_engine
    prompt = prompts([200])[0]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": prompt}, params)
    most_held = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        (request,) = engine.scheduler.running or [None]
        if request is not None:
            most_held = max(most_held, len(request.block_ids) - request.num_dropped_blocks)
    assert most_held <= (32 + 32) // 16 + 2  # the window and one chunk of new tokens, each maybe straddling a block
    assert_all_blocks_free(engine)
    first = outputs[0].outputs[0].token_ids
    again = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert engine.kv_cache_manager.prefix_cache_hits > 0 and again == first
