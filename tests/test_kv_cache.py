"""The default KV cache pool is sized from the available memory and max_model_len x max_num_seqs; its memory is
zero-filled by the OS on first touch, not at start-up."""
import logging

import pytest
import torch

from conftest import assert_all_blocks_free, num_clear_positions, top2_gap
from inferno import LLM, SamplingParams
from inferno.worker import kv_cache
from inferno.worker.kv_cache import available_memory, lazily_zeroed
from inferno.worker.model_runner import kv_bytes_per_block


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_lazily_zeroed_memory_is_zero_and_costs_nothing_until_touched():
    before = resident_bytes()
    cache = lazily_zeroed((4, 1 << 14, 16, 64), torch.float32)  # 256 MiB
    assert cache.data_ptr() % 4096 == 0 and cache.is_contiguous()
    assert resident_bytes() - before < (16 << 20)
    assert not cache[:, :8].any()  # reading pages maps the shared zero page
    cache[1, 5] = 1.0
    assert cache[1, 4:7].sum() == 16 * 64 and resident_bytes() - before < (16 << 20)


def test_available_memory_is_positive_and_at_most_the_ram():
    import os
    assert 0 < available_memory() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_default_pool_takes_a_share_of_the_available_memory(monkeypatch, model_path, caplog):
    monkeypatch.setattr(kv_cache, "available_memory", lambda: 64 << 20)
    with caplog.at_level(logging.INFO, logger="inferno"):
        llm = LLM(model_path)
    engine = llm.llm_engine
    block_bytes = kv_bytes_per_block(engine.model_config, 16, engine.config.kv_cache_dtype)
    assert engine.num_blocks == int((64 << 20) * kv_cache.AUTO_KV_CACHE_FRACTION) // block_bytes
    assert engine.max_model_len == engine.num_blocks * 16 < engine.model_config.max_position_embeddings
    assert f"KV cache: {engine.num_blocks} blocks = {engine.num_blocks * 16} tokens" in caplog.text
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert_all_blocks_free(engine)


def test_default_pool_holds_no_more_than_max_num_seqs_of_max_model_len(monkeypatch, model_path):
    monkeypatch.setattr(kv_cache, "available_memory", lambda: 1 << 40)
    engine = LLM(model_path, max_model_len=200, max_num_seqs=3).llm_engine
    assert engine.num_blocks == 3 * 13  # ceil(200 / 16) blocks per sequence
    assert engine.max_model_len == 200


def test_too_little_memory_for_one_block_is_a_clear_error(monkeypatch, model_path):
    monkeypatch.setattr(kv_cache, "available_memory", lambda: 1024)
    with pytest.raises(ValueError, match="too little memory is available for one KV block"):
        LLM(model_path)


def test_max_model_len_leaves_room_for_the_draft_models_lookahead_slots(model_path):
    """A request of max_model_len tokens plus the k slots the draft writes beyond it still fits the pool: it
    finishes instead of waiting forever for blocks."""
    llm = LLM(model_path, kv_cache_memory=4 << 20, speculative_config={
        "method": "draft_model", "model": model_path, "num_speculative_tokens": 3})
    engine = llm.llm_engine
    assert engine.max_model_len == engine.num_blocks * 16 - 3
    prompt = list(range(100, 100 + engine.max_model_len - 5))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": prompt + [7] * 5})
    assert_all_blocks_free(engine)


def test_float32_model_on_the_cpu_caches_kv_in_float16_by_default(model_path, llm):
    """kv_cache_dtype "auto" under a float32 model on the CPU is float16 (as llama.cpp stores its cache): half the
    bytes per block, and greedy decoding that follows the float32 cache (`llm`, FLOAT32) with log-probabilities
    within a few thousandths, up to its first near-tie."""
    half = LLM(model_path, quantization=None, dtype="float32", kv_cache_memory=64 << 20)
    engine = half.llm_engine
    assert engine.config.kv_cache_dtype == "float16"
    assert all(a.k_cache.dtype == a.v_cache.dtype == torch.float16 for a in engine.model_runner.model.attention_layers)
    assert (kv_bytes_per_block(engine.model_config, 16, "float16") * 2
            == kv_bytes_per_block(engine.model_config, 16, llm.llm_engine.config.kv_cache_dtype))
    tolerance = 0.01
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ref = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        out = half.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        clear = num_clear_positions([top2_gap(p) for p in ref.logprobs], tolerance, min_compared=8)
        assert out.token_ids[:clear] == ref.token_ids[:clear]
        for i in range(clear):
            token = ref.token_ids[i]
            assert abs(out.logprobs[i][token].logprob - ref.logprobs[i][token].logprob) < tolerance
    assert_all_blocks_free(engine)
