"""The torch.compile'd decode step computes what the eager one does, at batch 1 and with dynamic batch sizes."""
import pytest
from torch._dynamo.utils import counters

from conftest import is_near_tie, top2_gap
from inferno import LLM, SamplingParams
from inferno.kernels import paged_attention

pytestmark = pytest.mark.skipif(paged_attention() is None, reason="the compiled decode step needs the native kernel")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three facts about the Moon:\n1."]


def generate(llm: LLM, prompts: list[str]):
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


# int4 computes in bfloat16, logits included: one bf16 ulp of a logit near 20 is 0.125
@pytest.mark.parametrize("engine_args, tol", [({"dtype": "float32"}, 1e-4), ({"quantization": "int4"}, 0.15)])
def test_compiled_decode_matches_eager(engine_args, tol):
    eager = LLM(kv_cache_memory=64 << 20, enable_prefix_caching=False, enforce_eager=True, **engine_args)
    compiled = LLM(kv_cache_memory=64 << 20, enable_prefix_caching=False, enforce_eager=False, **engine_args)
    assert eager.llm_engine.model_runner.compiled_decode is None
    assert compiled.llm_engine.model_runner.compiled_decode is not None
    graphs = counters["stats"]["unique_graphs"]  # compiled at start-up: one request, and any batch
    for prompts in (PROMPTS[:1], PROMPTS):  # batch 1 (a specialised graph), then a dynamic batch size
        for ref, out in zip(generate(eager, prompts), generate(compiled, prompts)):
            for i, (token, lp) in enumerate(zip(ref.token_ids, ref.logprobs)):
                if out.token_ids[i] != token:  # only where the eager step's top-2 margin is within rounding
                    assert is_near_tie(top2_gap(lp), tol)
                    break
                assert abs(out.logprobs[i][token].logprob - lp[token].logprob) < tol
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation for other batch sizes or table widths
