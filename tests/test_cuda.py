"""The CUDA path, run whenever the machine has a GPU (skipped elsewhere): the whole step on the GPU — Triton
attention, CUDA graphs for decode steps, sampling — against HF transformers on the same GPU and against eager."""
import pytest
import torch

from conftest import assert_all_blocks_free, is_near_tie, prefill_logits
from inferno import LLM, SamplingParams
from inferno.loader.safetensors import read_config
from inferno.worker.model_runner import kv_bytes_per_block
from test_architectures import hf_greedy, prompts
from tiny_models import write_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    hf_model = write_hf_model(folder, "qwen3").cuda()
    return folder, hf_model


@pytest.mark.parametrize("enforce_eager", [True, False])  # False: decode steps replay CUDA graphs
def test_model_on_cuda_matches_hf(tiny, enforce_eager):
    folder, hf_model = tiny
    llm = LLM(model=str(folder), device="cuda", dtype="float32", kv_cache_memory=64 << 20,
              enforce_eager=enforce_eager)
    runner = llm.llm_engine.model_runner
    assert runner.attention.name == "triton" and (runner.decode_graphs is None) == enforce_eager
    ids = prompts([200])[0]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids], device="cuda")).logits[0]
    assert (prefill_logits(llm.llm_engine, ids) - ref).abs().max().item() < 1e-3
    batch = prompts([5, 40, 70, 23])
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    compared = 0
    for p, out in zip(batch, outs):
        with torch.inference_mode():
            ref_tokens, gaps = hf_greedy(hf_model.cpu(), p)
        hf_model.cuda()
        clear = next((i for i, gap in enumerate(gaps) if is_near_tie(gap, 0.01)), len(gaps))
        assert out.outputs[0].token_ids[:clear] == ref_tokens[:clear]
        compared += clear
    assert compared >= 8
    assert_all_blocks_free(llm.llm_engine)


def test_graphs_match_eager_with_preemption_and_prefix_hits(tiny):
    folder, _ = tiny
    batch = prompts([30, 50, 70, 90, 110, 130]) + prompts([130])  # the last one repeats a prompt: a prefix hit
    # 16 blocks: the longest request (130 + 24 tokens) takes 10, so the requests preempt one another
    cache_memory = 16 * kv_bytes_per_block(read_config(folder), 16, "bfloat16")
    results = []
    for eager in (True, False):
        llm = LLM(model=str(folder), device="cuda", dtype="bfloat16", kv_cache_memory=cache_memory,
                  max_num_batched_tokens=64, enforce_eager=eager)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], SamplingParams(temperature=0, max_tokens=24,
                                                                                      ignore_eos=True), use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
        assert llm.llm_engine.scheduler.num_preemptions > 0 and llm.llm_engine.kv_cache_manager.prefix_cache_hits > 0
        assert_all_blocks_free(llm.llm_engine)
    assert results[0] == results[1]


def test_seeded_sampling_on_cuda_is_reproducible(tiny):
    folder, _ = tiny
    llm = LLM(model=str(folder), device="cuda", kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
