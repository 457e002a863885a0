"""Shared fixtures: the default model loaded once, HF transformers as the numeric oracle."""
import os
from pathlib import Path

# Without a GPU, the Triton kernels (the GPU backend's) run on CPU tensors under Triton's interpreter, which is chosen
# as triton.language is imported (torch may import it): set before anything else.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from inferno import LLM
from inferno.engine.llm_engine import LLMEngine
from inferno.outputs import Logprob
from inferno.loader.model_loader import default_model_path
from inferno.request import Request
from inferno.sampling_params import SamplingParams
from inferno.worker.input_batch import MicroBatch, StepInput

# Engines in the tests run eagerly (and so do servers they start, which inherit the environment): compiling each
# configuration's decode step would cost tens of seconds apiece. tests/test_compile.py checks the compiled path.
os.environ["INFERNO_ENFORCE_EAGER"] = "1"
# The options of the float32 model: the GGUF file's weights dequantized (the default, quantization="auto", runs the
# file's blocks natively, tests/test_gguf_native.py). Tests comparing with HF or across engines use it.
FLOAT32 = {"quantization": None, "dtype": "float32", "kv_cache_dtype": "float32"}  # the float32 model, float32 cache


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def llm() -> LLM:
    return LLM(kv_cache_memory=512 << 20, **FLOAT32)


@pytest.fixture(scope="session")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM
    path = Path(model_path)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@torch.inference_mode()
def prefill_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """Logits [len, vocab] of one prompt through the engine's executor (every rank) and paged KV cache."""
    req = Request("logits", token_ids, SamplingParams(), set(), engine.max_model_len)
    assert engine.kv_cache_manager.allocate_slots(req, len(token_ids))
    try:
        bs = engine.config.block_size
        n = len(token_ids)
        mb = MicroBatch(list(token_ids), list(range(n)), [req.block_ids[p // bs] * bs + p % bs for p in range(n)],
                        decodes=[], prefills=[(n, 0, req.block_ids)], logit_rows=list(range(n)))
        return engine.executor.run_step(StepInput([mb], []))
    finally:
        engine.kv_cache_manager.free(req)


def assert_all_blocks_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_blocks


# greedy comparisons between two correct runs
def top2_gap(position: dict[int, Logprob]) -> float:
    """Gap between the two best log-probabilities at one position (a Logprob dict with at least two entries)."""
    best, second = sorted((lp.logprob for lp in position.values()), reverse=True)[:2]
    return best - second


def is_near_tie(gap: float, logit_tolerance: float) -> bool:
    """Two runs whose logits differ by up to `logit_tolerance` can order two tokens differently only when their
    gap is below twice that: there either greedy pick is right."""
    return gap < 2 * logit_tolerance


def num_clear_positions(gaps: list[float], logit_tolerance: float, min_compared: int = 1) -> int:
    """How many leading positions of a reference have a clear greedy choice (the tokens two runs must agree on, up to
    its first near-tie). Fails when fewer than `min_compared` (at least 1): comparing nothing proves nothing."""
    clear = next((i for i, gap in enumerate(gaps) if is_near_tie(gap, logit_tolerance)), len(gaps))
    assert clear >= max(1, min_compared), (f"the reference has a near-tie at position {clear}, leaving fewer than "
                                           f"{max(1, min_compared)} positions to compare; pick another prompt")
    return clear


def assert_same_greedy(reference, outputs, logit_tolerance: float, min_compared: int) -> None:
    """Two runs' greedy RequestOutputs (logprobs >= 2): the same tokens up to the reference's first near-tie, with
    logprobs within `logit_tolerance`."""
    for ref, out in zip(reference, outputs):
        ref, out = ref.outputs[0], out.outputs[0]
        clear = num_clear_positions([top2_gap(step) for step in ref.logprobs], logit_tolerance, min_compared)
        assert out.token_ids[:clear] == ref.token_ids[:clear], (out.token_ids, ref.token_ids)
        for ref_step, step in zip(ref.logprobs[:clear], out.logprobs[:clear]):
            for token, lp in ref_step.items():
                assert abs(step[token].logprob - lp.logprob) < logit_tolerance


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of observed `counts` under the distribution `probs` (Pearson's chi-square, len(probs) - 1
    degrees of freedom)."""
    expected = probs * counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2), statistic / 2))
