"""Tiles made with the runner: every pass over a runner's weights runs all its layers on tiles, its first included. A
draft model's runner makes its own like the target's, so speculative decoding with a draft model and seeded sampling
gives the same drafts, draft distributions and tokens in every run."""
import torch

from conftest import assert_all_blocks_free
from inferno import LLM, SamplingParams
from inferno.layers.quantization.linear import QuantizedLinear
from native_kernels import needs_kernels
from tiny_gguf import T, write_tiny_gguf

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three facts about the Moon:\n1."]
PARAMS = [SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=16, ignore_eos=True) for seed in (1, 2, 3)]


def speculative_run(path: str):
    """The tokens of a draft-model run; per proposal, its drafts and their distributions, and per pass in it, which of
    the draft's layers ran on tiles."""
    llm = LLM(path, kv_cache_memory=8 << 20, enforce_eager=True,
              speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3})
    proposer = llm.llm_engine.executor.worker.proposer
    runner, propose, forward = proposer.runner, proposer.propose, proposer.runner.forward
    layers = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear) and m.can_tile]
    assert layers
    proposals = []  # (draft output, [per pass: [whether each layer has tiles]])

    def recording_propose(requests):
        proposals.append((None, []))
        out = propose(requests)
        proposals[-1] = (out, proposals[-1][1])
        return out

    def recording_forward(mb, hidden=None):
        proposals[-1][1].append([m.tiles is not None for m in layers])
        return forward(mb, hidden)

    proposer.propose, runner.forward = recording_propose, recording_forward
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert_all_blocks_free(llm.llm_engine)
    return [o.outputs[0].token_ids for o in outputs], proposals


@needs_kernels
def test_draft_model_speculation_with_seeded_sampling_is_reproducible(tmp_path):
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", T.Q4_1))  # int4 (tiles round unlike the rows); its own draft
    tokens, proposals = speculative_run(path)
    again, proposals_again = speculative_run(path)
    for run in (proposals, proposals_again):
        assert len(run) > 2 and len(run[0][1]) >= 2  # the first proposal: more than one pass
        assert all(all(map(all, passes)) for _, passes in run)
    assert again == tokens
    assert any(out.draft_probs for out, _ in proposals)
    for (out, _), (out_again, _) in zip(proposals, proposals_again, strict=True):
        assert out_again.spec_token_ids == out.spec_token_ids
        assert out_again.draft_probs.keys() == out.draft_probs.keys()
        assert all(torch.equal(out.draft_probs[r], out_again.draft_probs[r]) for r in out.draft_probs)
