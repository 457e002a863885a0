"""An EAGLE head proposes a chain of drafts autoregressively, from the target's own features, on its own KV cache.

The head's K/V at position p come from the token at p + 1 and the target's feature (final hidden state, after the
final norm) at p, which the target runner keeps for every position it ran and accepted (`target_hidden`). After a
step, a request of n tokens catches its head cache up over positions valid..n-2 in one pass (its whole prompt the
first time); the head's output at n-2 gives draft 1 (the token at n). Draft j + 1 comes from one more pass at
position n-2+j over draft j and the head's own output at the position before, standing in for the target's
feature there. Greedy requests take each pass's top-1; sampled ones draw from its processed softmax, passed on as
the draft distribution so that rejection sampling keeps the target's output distribution exact.

The cache is one layer's paged K/V addressed by the target's block tables (like the draft model's): drafts write
into the lookahead slots the scheduler reserves. K/V written from the head's own outputs (draft positions) are
never trusted: the next proposal rewrites them from the target's features once the target has run those
positions; before proposing, the cached tokens and blocks are compared with the request's and only the matching
prefix is kept (rejected drafts, preemption, copy-on-write all fall out of that).

A later tree search would run each depth's passes over several candidates per request: the per-depth pass here
(`_pass`) already takes any set of (position, token, feature, block table) rows; a tree needs an attention mask
over sibling candidates, which the paged backends do not take yet (issue 42, item 3).
"""

import torch

from inferno.config import EngineConfig, ModelConfig
from inferno.core.scheduler_output import DraftOutput
from inferno.layers.attention import select_attention_backend
from inferno.loader.eagle_folder import EagleFolder, eagle_head_config, read_eagle_folder
from inferno.loader.model_loader import load_weights
from inferno.model.eagle import EagleHead
from inferno.worker.input_batch import TokenChunk, lay_out_chunks
from inferno.worker.kv_cache import lazily_zeroed
from inferno.worker.model_runner import ModelRunner
from inferno.worker.spec_decode.draft_sampling import sample_drafts
from inferno.worker.spec_decode.drafting_request import DraftingRequest
from inferno.worker.spec_decode.proposer_cache import ProposerCache, live_caches
from inferno.worker.spec_decode.target_hidden import TargetHiddenStates


def build_eagle_head(folder: EagleFolder, target: ModelConfig) -> EagleHead:
    """The head of `folder` as a float32 module, checked against the target."""
    head = EagleHead(eagle_head_config(folder, target), folder.fc_bias, folder.own_lm_head)
    load_weights(head, folder.tensors.items())
    return head.eval().requires_grad_(False)


def load_eagle_head(path: str, target: ModelConfig, dtype: torch.dtype, device: torch.device) -> EagleHead:
    head = build_eagle_head(read_eagle_folder(path), target).to(device=device, dtype=dtype)
    head.rotary.cos_sin_cache = head.rotary.cos_sin_cache.to(device)
    return head


def head_kv_bytes_per_block(head: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * block_size * head.num_key_value_heads * head.head_dim * dtype.itemsize


class EagleProposer:
    def __init__(self, head: EagleHead, runner: ModelRunner, config: EngineConfig):
        self.head = head
        self.runner = runner
        self.target = runner.model
        self.block_size = config.block_size
        runner.target_hidden = TargetHiddenStates()  # from now on the runner keeps the target's features
        attn, shape = head.attention, head.config
        attn.backend = select_attention_backend(
            config.attention_backend, runner.device, self.block_size, attn.num_kv_heads, runner.num_blocks,
            shape.head_dim, None, False, None)
        cache_shape = (attn.num_kv_heads, runner.num_blocks, self.block_size, shape.head_dim)
        attn.k_cache, attn.v_cache = (torch.zeros(cache_shape, dtype=runner.dtype, device=runner.device)
                                      if runner.device.type == "cuda" else lazily_zeroed(cache_shape, runner.dtype)
                                      for _ in range(2))
        self.cached: dict[str, ProposerCache] = {}

    @torch.inference_mode()
    def propose(self, requests: list[DraftingRequest]) -> DraftOutput:
        """num_draft_tokens drafts per request, fewer where the scheduler's reserved slots end."""
        self.cached = live_caches(self.cached, self.runner.requests)
        wanted: list[tuple[DraftingRequest, int]] = []
        for req in requests:
            # draft j's K/V go to position n-3+j (n tokens): only into the slots the scheduler reserved
            k = min(req.num_draft_tokens, len(req.block_ids) * self.block_size - req.num_tokens + 2)
            if k > 0 and req.num_tokens >= 2:
                wanted.append((req, k))
        out = DraftOutput()
        if not wanted:
            return out
        chunks, features = [], []
        template = torch.empty(0, self.target.config.hidden_size, dtype=self.runner.dtype, device=self.runner.device)
        for req, _ in wanted:
            cache = self.cached.get(req.request_id)
            valid = min(cache.num_valid_positions(req, self.block_size) if cache else 0, req.num_tokens - 2)
            chunks.append(TokenChunk(req.token_ids[valid + 1:], valid, req.block_ids))
            features.append(self.runner.target_hidden.take(req.request_id, valid, req.num_tokens - 1, template))
        # the target's embedding, norm and head: their weights may switch to tiles between passes
        with self.runner.tile_switch.step():
            features = self.target.norm(torch.cat(features))
            drafts: list[list[int]] = [[] for _ in wanted]
            probs: list[list[torch.Tensor]] = [[] for _ in wanted]
            active = list(range(len(wanted)))
            while active:
                last = self._pass(chunks, features)
                logits = self.head.logits(last, self.target.lm_head)
                tokens, q = sample_drafts(logits, [(wanted[i][0], drafts[i]) for i in active],
                                          self.target.config.vocab_size, self.runner.device)
                for row, i in enumerate(active):
                    drafts[i].append(tokens[row])
                    if q is not None and not wanted[i][0].sampling_params.greedy:
                        probs[i].append(q[row])
                going = [row for row, i in enumerate(active) if len(drafts[i]) < wanted[i][1]]
                active = [active[row] for row in going]
                chunks = [TokenChunk([drafts[i][-1]], wanted[i][0].num_tokens + len(drafts[i]) - 2,
                                     wanted[i][0].block_ids) for i in active]
                features = last[going]
        for (req, _), tokens, q in zip(wanted, drafts, probs):
            out.spec_token_ids[req.request_id] = tokens
            if q:
                out.draft_probs[req.request_id] = torch.stack(q).cpu()
            self.cached[req.request_id] = ProposerCache(req.state, list(req.token_ids), list(req.block_ids),
                                                        req.num_preemptions, tokens_ahead=1)
        return out

    def _pass(self, chunks: list[TokenChunk], features: torch.Tensor) -> torch.Tensor:
        """One pass of the head over the chunks (each: the tokens at p + 1 for its positions p, its rows of
        `features` in order), writing their K/V; the head's output at each chunk's last position, in chunk order."""
        mb = lay_out_chunks(chunks, self.block_size)
        # lay_out_chunks puts decode-like chunks first: each chunk's rows end at its logit row
        lengths = [len(c.token_ids) for c in chunks]
        rows = torch.cat([torch.arange(end - n + 1, end + 1) for end, n in zip(mb.logit_rows, lengths)])
        device = self.runner.device
        laid_out = torch.empty_like(features)
        laid_out[rows.to(device)] = features
        input_ids, positions = (torch.tensor(v, dtype=torch.long, device=device) for v in (mb.input_ids, mb.positions))
        meta = self.head.attention.backend.build_metadata(mb.slot_mapping, mb.decodes, mb.prefills)
        out = self.head(self.target.embed_tokens(input_ids), laid_out, positions, meta)
        return out[torch.tensor(mb.logit_rows, dtype=torch.long, device=device)]
