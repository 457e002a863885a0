"""A smaller model with the target's tokenizer proposes k tokens, run batched across requests.

The draft has its own paged KV cache (tensors sized for its own layers) addressed by the target's block tables:
position p of a request lives in the same slot in both caches. The scheduler reserves `num_speculative_tokens`
lookahead slots beyond each running request's scheduled tokens, which is where the draft writes K/V for its
drafts. Draft K/V of rejected tokens is simply not trusted: before proposing, the cached prefix is compared with
the request's tokens and only the matching part is kept, the rest is recomputed (and overwritten).
"""
import numpy as np
import torch

from inferno.config import EngineConfig, ModelConfig, SpeculativeConfig
from inferno.layers.sampler import process_logits, random_sample
from inferno.loader.model_loader import load_model
from inferno.request import Request
from inferno.spec_decode import num_drafts_wanted
from inferno.worker.input_batch import TokenChunk, lay_out_chunks
from inferno.worker.model_runner import ModelRunner, sampling_metadata


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(mismatch[0]) if len(mismatch) else n


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, engine_config: EngineConfig, num_blocks: int, target: ModelConfig):
        loaded = load_model(config.model, engine_config.torch_dtype)
        if loaded.config.vocab_size != target.vocab_size:
            raise ValueError(f"draft model {config.model!r} has a vocabulary of {loaded.config.vocab_size} tokens but "
                             f"the target has {target.vocab_size}: a draft model must share the target's tokenizer")
        self.model_path = loaded.path
        self.runner = ModelRunner(loaded.model, engine_config, num_blocks)
        self.k = config.num_speculative_tokens
        self.block_size = engine_config.block_size
        self.vocab_size = target.vocab_size
        # request id -> (tokens whose draft K/V is in the cache, from position 0; the blocks it was written to)
        self.cached: dict[str, tuple[list[int], list[int]]] = {}

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> None:
        """Sets `spec_token_ids` (and `draft_probs` for sampled requests) of the running requests that speculate."""
        self.cached = {r.request_id: self.cached[r.request_id] for r in requests if r.request_id in self.cached}
        wanted: list[tuple[Request, int]] = []
        for req in requests:
            # drafts are written up to position num_tokens + k - 2: only into the slots the scheduler reserved
            k = min(num_drafts_wanted(req, self.k), len(req.block_ids) * self.block_size - req.num_tokens + 1)
            if k > 0:
                wanted.append((req, k))
        if not wanted:
            return
        chunks = []
        for req, _ in wanted:
            tokens, blocks = self.cached.get(req.request_id, ([], []))
            # a block replaced since (copy-on-write of a block shared with a fork) holds no draft K/V
            valid = min(common_prefix_length(tokens, req.token_ids),
                        common_prefix_length(blocks, req.block_ids) * self.block_size, req.num_tokens - 1)
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
            self.cached[req.request_id] = (req.token_ids + tokens[:-1], list(req.block_ids))

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
