"""A smaller model with the target's tokenizer proposes k tokens, run batched across requests, whole on rank 0.

The draft is not split over tensor or pipeline ranks, whatever the target is: it is small, and split it would need
collectives (or stage hand-offs) for each of its k sequential passes per step. Rank 0, which samples, runs it.

The draft has its own paged KV cache (tensors sized for its own layers) addressed by the target's block tables:
position p of a request lives in the same slot in both caches. The scheduler reserves `num_speculative_tokens`
lookahead slots beyond each running request's scheduled tokens, which is where the draft writes K/V for its
drafts. Draft K/V of rejected tokens is simply not trusted: before proposing, the cached prefix is compared with
the request's tokens and only the matching part is kept, the rest is recomputed (and overwritten).
"""
from dataclasses import replace

import torch

from inferno.config import EngineConfig, ModelConfig
from inferno.core.scheduler_output import DraftOutput
from inferno.loader.model_loader import load_model
from inferno.model.llama import LlamaForCausalLM
from inferno.speculative_config import SpeculativeConfig
from inferno.worker.input_batch import TokenChunk, lay_out_chunks
from inferno.worker.model_runner import ModelRunner
from inferno.worker.request_state import CachedRequestState
from inferno.worker.spec_decode.draft_sampling import sample_drafts
from inferno.worker.spec_decode.drafting_request import DraftingRequest
from inferno.worker.spec_decode.proposer_cache import ProposerCache, live_caches


def load_draft_model(spec: SpeculativeConfig, config: EngineConfig, target: ModelConfig, quantization: str | None,
                     device: torch.device) -> LlamaForCausalLM:
    """The whole draft model, on `device` (`quantization` as the target's)."""
    loaded = load_model(spec.model, config.torch_dtype, quantization=quantization,
                        group_size=config.quantization_group_size)
    if loaded.config.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {spec.model!r} has a vocabulary of {loaded.config.vocab_size} tokens but "
                         f"the target has {target.vocab_size}: a draft model must share the target's tokenizer")
    if device.type == "cuda":
        loaded.model.to_device(device)
    return loaded.model


class DraftModelProposer:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, num_blocks: int,
                 states: dict[str, CachedRequestState], device: torch.device):
        # the drafts come from the base draft model: LoRA adapters are the target's, which verifies them
        self.runner = ModelRunner(model, replace(config, enable_lora=False), num_blocks, device=device)
        self.block_size = config.block_size
        self.vocab_size = model.config.vocab_size
        self.states = states  # the target runner's request states: a request gone from them has ended
        self.cached: dict[str, ProposerCache] = {}  # request id -> its draft K/V

    @torch.inference_mode()
    def propose(self, requests: list[DraftingRequest]) -> DraftOutput:
        """num_draft_tokens drafts per request, fewer where the scheduler's reserved slots end. Requests not asked
        keep their cached draft K/V (they may speculate again later and catch up from it)."""
        self.cached = live_caches(self.cached, self.states)
        wanted: list[tuple[DraftingRequest, int]] = []
        for req in requests:
            # drafts are written up to position num_tokens + k - 2: only into the slots the scheduler reserved
            k = min(req.num_draft_tokens, len(req.block_ids) * self.block_size - req.num_tokens + 1)
            if k > 0:
                wanted.append((req, k))
        out = DraftOutput()
        if not wanted:
            return out
        self._propose(wanted, out)
        self.runner.step_done()  # its passes are its runner's steps (the warm-up waits for the first)
        return out

    def _propose(self, wanted: list[tuple[DraftingRequest, int]], out: DraftOutput) -> None:
        chunks = []
        for req, _ in wanted:
            cache = self.cached.get(req.request_id)
            valid = cache.num_valid_positions(req, self.block_size) if cache else 0
            chunks.append(TokenChunk(req.token_ids[valid:], valid, req.block_ids))
        drafts: list[list[int]] = [[] for _ in wanted]
        probs: list[list[torch.Tensor]] = [[] for _ in wanted]
        active = list(range(len(wanted)))
        while active:
            tokens, q = self._step(chunks, [(wanted[i][0], drafts[i]) for i in active])
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                if q is not None and not wanted[i][0].sampling_params.greedy:
                    probs[i].append(q[row])
            active = [i for i in active if len(drafts[i]) < wanted[i][1]]
            chunks = [TokenChunk([drafts[i][-1]], wanted[i][0].num_tokens + len(drafts[i]) - 1, wanted[i][0].block_ids)
                      for i in active]
        for (req, _), tokens, q in zip(wanted, drafts, probs):
            out.spec_token_ids[req.request_id] = tokens
            if q:
                out.draft_probs[req.request_id] = torch.stack(q).cpu()
            self.cached[req.request_id] = ProposerCache(req.state, req.token_ids + tokens[:-1], list(req.block_ids),
                                                        req.num_preemptions)

    def _step(self, chunks: list[TokenChunk], rows: list[tuple[DraftingRequest, list[int]]]) -> tuple[list[int], torch.Tensor | None]:
        """One draft forward pass: the next token of each chunk's sequence, and the distributions they were sampled
        from (None when every request is greedy)."""
        mb = lay_out_chunks(chunks, self.block_size)
        logits = self.runner.model.compute_logits(self.runner.forward(mb)[mb.logit_rows])
        return sample_drafts(logits, rows, self.vocab_size, self.runner.device)
