"""Device choice and the GPU's KV cache sizing: what can be checked without a GPU here, the rest on one
(tests/test_cuda.py)."""
import pytest
import torch

from conftest import FLOAT32
from inferno import LLM
from inferno.config import EngineConfig
from inferno.worker.cuda_graphs import padded_size
from inferno.worker.gpu_memory import GIB, kv_cache_budget, profile_step
from tiny_models import write_hf_model


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")
def test_device_auto_is_the_cpu_and_cuda_without_a_gpu_is_a_clear_error():
    assert EngineConfig().device == "cpu"
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        EngineConfig(device="cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        EngineConfig(device="tpu")


def test_gpu_memory_utilization_is_checked():
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)


def test_kv_cache_budget_is_what_utilization_leaves_and_says_what_does_not_fit():
    assert kv_cache_budget(80 * GIB, 1 * GIB, 20 * GIB, 0.9) == int(72 * GIB) - 21 * GIB
    with pytest.raises(ValueError, match=r"does not fit: .*take 70.00 GiB"):
        kv_cache_budget(80 * GIB, 1 * GIB, 70 * GIB, 0.5)


def test_the_profiling_step_is_the_largest_step_and_runs(tmp_path):
    """The step measured on a GPU before sizing the cache: max_num_batched_tokens of prefill (capped by the
    context), one logit row per sequence; it runs through a real model runner (here on the CPU)."""
    step, blocks = profile_step(max_num_batched_tokens=100, max_model_len=64, max_num_seqs=8, block_size=16)
    (mb,) = step.micro_batches
    assert len(mb.input_ids) == 64 and blocks == 4 and len(mb.logit_rows) == 8 and mb.prefills == [(64, 0, [0, 1, 2, 3])]
    write_hf_model(tmp_path, "qwen3")
    llm = LLM(model=str(tmp_path), **FLOAT32, kv_cache_memory=blocks * 16 * 2 * 2 * 2 * 32 * 4)
    logits = llm.llm_engine.executor.run_step(step)
    assert logits.shape == (8, llm.llm_engine.model_config.vocab_size) and torch.isfinite(logits).all()


def test_decode_batches_pad_to_the_next_captured_size():
    sizes = (1, 2, 4, 8, 16)
    assert [padded_size(b, sizes) for b in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, None]
