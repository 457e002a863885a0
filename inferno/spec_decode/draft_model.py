"""A smaller model with the target's tokenizer proposes k tokens, run batched across requests.

The draft has its own paged KV cache (tensors sized for its own layers) addressed by the target's block tables:
position p of a request lives in the same slot in both caches. The scheduler reserves `num_speculative_tokens`
lookahead slots beyond each running request's scheduled tokens, which is where the draft writes K/V for its
drafts. Draft K/V of rejected tokens is simply not trusted: before proposing, the cached prefix is compared with
the request's tokens and only the matching part is kept, the rest is recomputed (and overwritten).
"""
from dataclasses import dataclass

import numpy as np
import torch

from inferno.config import EngineConfig, ModelConfig, SpeculativeConfig
from inferno.layers.sampler import process_logits, random_sample
from inferno.loader.model_loader import load_model
from inferno.request import Request
from inferno.worker.input_batch import TokenChunk, lay_out_chunks
from inferno.worker.model_runner import ModelRunner, sampling_metadata


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(mismatch[0]) if len(mismatch) else n


@dataclass(slots=True)
class DraftCache:
    """What the draft's KV cache holds for a request: K/V of `token_ids` (from position 0) in `block_ids`."""
    request: Request
    token_ids: list[int]
    block_ids: list[int]
    num_preemptions: int  # the request's count when written: a preemption gave its blocks away

    def num_valid_tokens(self, block_size: int) -> int:
        """Leading tokens of the request whose draft K/V can be read (at most all but its last token)."""
        req = self.request
        if req.num_preemptions != self.num_preemptions:
            return 0
        # a block replaced since (copy-on-write of a block shared with a fork) holds no draft K/V
        return min(common_prefix_length(self.token_ids, req.token_ids),
                   common_prefix_length(self.block_ids, req.block_ids) * block_size, req.num_tokens - 1)


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, engine_config: EngineConfig, num_blocks: int, target: ModelConfig):
        loaded = load_model(config.model, engine_config.torch_dtype, quantization=engine_config.quantization,
                            group_size=engine_config.quantization_group_size)
        if loaded.config.vocab_size != target.vocab_size:
            raise ValueError(f"draft model {config.model!r} has a vocabulary of {loaded.config.vocab_size} tokens but "
                             f"the target has {target.vocab_size}: a draft model must share the target's tokenizer")
        self.model_path = loaded.path
        self.runner = ModelRunner(loaded.model, engine_config, num_blocks)
        self.block_size = engine_config.block_size
        self.vocab_size = target.vocab_size
        self.cached: dict[str, DraftCache] = {}  # request id -> its draft K/V

    @torch.inference_mode()
    def propose(self, planned: list[tuple[Request, int]]) -> None:
        """Sets `spec_token_ids` (and `draft_probs` for sampled requests) of each (request, k) that speculates: k
        drafts, fewer where the scheduler's reserved slots end. Requests not planned keep their cached draft K/V
        (they may speculate again later and catch up from it)."""
        self.cached = {rid: c for rid, c in self.cached.items() if not c.request.is_finished}
        wanted: list[tuple[Request, int]] = []
        for req, k in planned:
            # drafts are written up to position num_tokens + k - 2: only into the slots the scheduler reserved
            k = min(k, len(req.block_ids) * self.block_size - req.num_tokens + 1)
            if k > 0:
                wanted.append((req, k))
        if not wanted:
            return
        chunks = []
        for req, _ in wanted:
            cache = self.cached.get(req.request_id)
            valid = cache.num_valid_tokens(self.block_size) if cache else 0
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
            req.spec_token_ids = tokens
            req.draft_probs = torch.stack(q) if q else None
            self.cached[req.request_id] = DraftCache(req, req.token_ids + tokens[:-1], list(req.block_ids),
                                                     req.num_preemptions)

    def _step(self, chunks: list[TokenChunk], rows: list[tuple[Request, list[int]]]) -> tuple[list[int], torch.Tensor | None]:
        """One draft forward pass: the next token of each chunk's sequence, and the distributions they were sampled
        from (None when every request is greedy)."""
        mb = lay_out_chunks(chunks, self.block_size)
        logits = self.runner.model.compute_logits(self.runner.forward(mb)[mb.logit_rows])
        md = sampling_metadata(rows, self.vocab_size)
        logits, greedy = process_logits(logits, md)
        if md.all_greedy:
            return greedy.tolist(), None
        q = logits.softmax(dim=-1)
        sampled = torch.where(md.temperature > 0, random_sample(q.clone(), md.generators), greedy)
        return sampled.tolist(), q
