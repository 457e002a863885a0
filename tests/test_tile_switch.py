"""The tile switch: every pass over a runner's weights runs all its layers on tiles, its first included, whenever the
warm-up would make them. A draft model's runner obeys it like the target's (a proposal of k passes is one pass over
its weights), so speculative decoding with a draft model and seeded sampling gives the same drafts, draft
distributions and tokens in every run."""
import threading

import torch

from conftest import assert_all_blocks_free
from inferno import LLM, SamplingParams
from inferno.layers.quantization.linear import QuantizedLinear
from inferno.worker import warm_up
from native_kernels import needs_kernels
from tiny_gguf import T, write_tiny_gguf

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three facts about the Moon:\n1."]
PARAMS = [SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=16, ignore_eos=True) for seed in (1, 2, 3)]


def speculative_run(path: str, warm_up_mid_proposal: bool):
    """The tokens of a draft-model run; per proposal, its drafts and their distributions, and per pass in it, which of
    the draft's layers ran on tiles. `warm_up_mid_proposal`: in the middle of the first proposal (after its first
    pass), the warm-up's tiling is started on another thread and given half a second."""
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
        passes = proposals[-1][1]
        if warm_up_mid_proposal and len(proposals) == 1 and len(passes) == 1:
            tiling = threading.Thread(target=runner.tile_switch.tile_between_steps, args=(0,))
            tiling.start()
            tiling.join(0.5)  # had it tiled now, the passes below would run on tiles
        passes.append([m.tiles is not None for m in layers])
        return forward(mb, hidden)

    proposer.propose, runner.forward = recording_propose, recording_forward
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert_all_blocks_free(llm.llm_engine)
    return [o.outputs[0].token_ids for o in outputs], proposals


@needs_kernels
def test_draft_model_speculation_with_seeded_sampling_is_reproducible(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_up, "WARM_UP_DELAY", 600)  # the warm-up makes no tiles before the first pass
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", T.Q4_1))  # int4 (tiles round unlike the rows); its own draft
    tokens, proposals = speculative_run(path, warm_up_mid_proposal=True)
    again, proposals_again = speculative_run(path, warm_up_mid_proposal=False)
    for run in (proposals, proposals_again):
        assert len(run) > 2 and len(run[0][1]) >= 2  # the first proposal: more than one pass
        assert all(all(map(all, passes)) for _, passes in run)
    assert again == tokens
    assert any(out.draft_probs for out, _ in proposals)
    for (out, _), (out_again, _) in zip(proposals, proposals_again, strict=True):
        assert out_again.spec_token_ids == out.spec_token_ids
        assert out_again.draft_probs.keys() == out.draft_probs.keys()
        assert all(torch.equal(out.draft_probs[r], out_again.draft_probs[r]) for r in out.draft_probs)
