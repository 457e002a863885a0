"""An EAGLE head proposes a chain (or a tree) of drafts autoregressively, from the target's own features, on its
own KV cache.

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

With a token tree (`speculative_token_tree`), a request the policy lets propose one drafts it depth by depth
(eagle_tree.py): each pass runs the current depth's expanded nodes as decode rows, each masked to the context and
its own ancestors with the target's tree-row machinery, and a node's children come from its output's top tokens (a
static tree's: the ranks their paths name; EAGLE-2's dynamic tree: the best by cumulative draft probability). Its
nodes are verified as point masses (layers/tree_rejection_sampler.py), exact whatever the request's sampling.
"""

import torch

from inferno.config import EngineConfig, ModelConfig
from inferno.core.scheduler_output import DraftOutput
from inferno.layers.attention import select_attention_backend
from inferno.layers.packed_linear import packable
from inferno.loader.eagle_folder import EagleFolder, eagle_head_config, read_eagle_folder
from inferno.loader.model_loader import load_weights
from inferno.model.eagle import EagleHead
from inferno.speculative_config import DYNAMIC_TREE
from inferno.worker.input_batch import TokenChunk, lay_out_chunks
from inferno.worker.kv_cache import lazily_zeroed
from inferno.worker.model_runner import ModelRunner
from inferno.worker.spec_decode.draft_sampling import sample_drafts
from inferno.worker.spec_decode.drafting_request import DraftingRequest
from inferno.worker.spec_decode.eagle_tree import DraftTree, DynamicTree, StaticTree
from inferno.worker.spec_decode.proposer_cache import ProposerCache, live_caches
from inferno.worker.spec_decode.target_hidden import TargetHiddenStates
from inferno.worker.tiles import pack_weights


def build_eagle_head(folder: EagleFolder, target: ModelConfig) -> EagleHead:
    """The head of `folder` as a float32 module, checked against the target."""
    draft_to_target = folder.draft_to_target
    head = EagleHead(eagle_head_config(folder, target), folder.fc_bias, folder.own_lm_head,
                     None if draft_to_target is None else len(draft_to_target))
    load_weights(head, ((name, t) for name, t in folder.tensors.items() if name != "d2t"))
    if draft_to_target is not None:
        head.set_draft_vocabulary(draft_to_target)
    return head.eval().requires_grad_(False)


def head_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype an EAGLE head runs in (its weights and its KV cache): the model's, but bfloat16 for a float32 model
    on a CPU with oneDNN's bfloat16 inner product: a draft pass streams half the bytes of float32 packed copies (32,768
    LM head rows took 2.6 ms of CPU in bfloat16 against 10 on float32 `F.linear`)."""
    if dtype == torch.float32 and device.type == "cpu" and packable(torch.zeros(1, 1, dtype=torch.bfloat16)):
        return torch.bfloat16
    return dtype


def load_eagle_head(path: str, target: ModelConfig, dtype: torch.dtype, device: torch.device) -> EagleHead:
    """The head on `device` in `head_dtype`; on the CPU its weights get their oneDNN copies now (the target's get
    theirs when the runner is built, worker/tiles.py): a draft pass then streams them ~4 times faster than bfloat16
    `F.linear`, which reorders the plain weight on every call."""
    head = build_eagle_head(read_eagle_folder(path), target).to(device=device, dtype=head_dtype(dtype, device))
    head.rotary.cos_sin_cache = head.rotary.cos_sin_cache.to(device)
    pack_weights([p for p in head.parameters() if packable(p)])
    return head


def head_kv_bytes_per_block(head: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * block_size * head.num_key_value_heads * head.head_dim * dtype.itemsize


class EagleProposer:
    def __init__(self, head: EagleHead, runner: ModelRunner, config: EngineConfig):
        self.head = head
        self.spec = config.speculative_config
        self.runner = runner
        self.target = runner.model
        self.block_size = config.block_size
        runner.target_hidden = TargetHiddenStates()  # from now on the runner keeps the target's features
        attn, shape = head.attention, head.config
        attn.backend = select_attention_backend(
            config.attention_backend, runner.device, self.block_size, attn.num_kv_heads, runner.num_blocks,
            shape.head_dim, None, False, None)
        cache_shape = (attn.num_kv_heads, runner.num_blocks, self.block_size, shape.head_dim)
        dtype = head.fc.weight.dtype  # head_dtype
        attn.k_cache, attn.v_cache = (torch.zeros(cache_shape, dtype=dtype, device=runner.device)
                                      if runner.device.type == "cuda" else lazily_zeroed(cache_shape, dtype)
                                      for _ in range(2))
        self.cached: dict[str, ProposerCache] = {}

    @torch.inference_mode()
    def propose(self, requests: list[DraftingRequest]) -> DraftOutput:
        """num_draft_tokens drafts per request, fewer where the scheduler's reserved slots end; a tree (cut to
        num_draft_tokens deep) for the requests the policy lets propose one."""
        self.cached = live_caches(self.cached, self.runner.requests)
        wanted: list[tuple[DraftingRequest, int]] = []
        for req in requests:
            # a chain's draft j writes its K/V at position n-3+j (n tokens): only into the slots the scheduler reserved
            k = min(req.num_draft_tokens, self._num_slots_after_root(req) + 1)
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
        roots = self._pass(chunks, self.target.norm(torch.cat(features)))
        trees = [i for i, (req, _) in enumerate(wanted) if req.tree and self.spec.speculative_token_tree]
        chains = [i for i in range(len(wanted)) if i not in trees]
        if chains:
            self._draft_chains([wanted[i] for i in chains], roots[chains], out)
        if trees:
            self._draft_trees([wanted[i] for i in trees], roots[trees], out)
        for req, _ in wanted:
            self.cached[req.request_id] = ProposerCache(req.state, list(req.token_ids), list(req.block_ids),
                                                        req.num_preemptions, tokens_ahead=1)
        return out

    def _num_slots_after_root(self, req: DraftingRequest) -> int:
        """The request's reserved slots after its head root's (position n-2 for n tokens)."""
        return len(req.block_ids) * self.block_size - req.num_tokens + 1

    def _draft_chains(self, wanted: list[tuple[DraftingRequest, int]], last: torch.Tensor, out: DraftOutput) -> None:
        """k drafts per request, one pass each after the first from the head's output `last` at the root."""
        drafts: list[list[int]] = [[] for _ in wanted]
        probs: list[list[torch.Tensor]] = [[] for _ in wanted]
        active = list(range(len(wanted)))
        while True:
            logits = self.head.logits(last, self.target.lm_head)
            tokens, q = sample_drafts(logits, [(wanted[i][0], drafts[i]) for i in active],
                                      self.target.config.vocab_size, self.runner.device)
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                if q is not None and not wanted[i][0].sampling_params.greedy:
                    probs[i].append(q[row])
            going = [row for row, i in enumerate(active) if len(drafts[i]) < wanted[i][1]]
            if not going:
                break
            active = [active[row] for row in going]
            chunks = [TokenChunk([drafts[i][-1]], wanted[i][0].num_tokens + len(drafts[i]) - 2,
                                 wanted[i][0].block_ids) for i in active]
            last = self._pass(chunks, last[going])
        for (req, _), tokens, q in zip(wanted, drafts, probs):
            out.spec_token_ids[req.request_id] = tokens
            if q:
                out.draft_probs[req.request_id] = torch.stack(q).cpu()

    def _draft_trees(self, wanted: list[tuple[DraftingRequest, int]], roots: torch.Tensor, out: DraftOutput) -> None:
        """Each request's tree up to k deep, depth by depth: the passes of a depth's expanded nodes run as one batch,
        and each pass's top tokens become the node's children (the root's pass: the catch-up's last, `roots`). Point
        masses: the tree rejection sampler keeps any request's output exact."""
        trees = [self._tree(req, k) for req, k in wanted]
        frontier, last = [(i, 0) for i in range(len(wanted))], roots
        while frontier:
            logprobs = self.head.logits(last, self.target.lm_head).log_softmax(dim=-1)
            top = logprobs.topk(max(trees[i].width for i, _ in frontier), dim=-1)
            ids, values = top.indices.tolist(), top.values.tolist()
            for row, (i, node) in enumerate(frontier):
                trees[i].grow(node, ids[row], values[row])
            parent_rows = {(i, node): row for row, (i, node) in enumerate(frontier)}
            frontier = [(i, node) for i, tree in enumerate(trees) for node in tree.expand()]
            if not frontier:
                break
            chunks, rows = [], []
            for i, node in frontier:
                req, tree = wanted[i][0], trees[i]
                root = req.num_tokens - 2
                chunks.append(TokenChunk([tree.token_ids[node]], tree.pass_slot(node, root), req.block_ids))
                rows.append((root + tree.shape.depths()[node], tree.hidden_slots(node, root)))
            parents = [parent_rows[(i, trees[i].shape.parent(node))] for i, node in frontier]
            last = self._pass(chunks, last[parents], rows)
        for (req, _), tree in zip(wanted, trees):
            out.spec_token_ids[req.request_id], out.spec_tree_parents[req.request_id] = tree.drafts()

    def _tree(self, req: DraftingRequest, depth: int) -> DraftTree:
        """The request's tree up to `depth`, its passes within the slots reserved after its root."""
        spec, slots = self.spec, self._num_slots_after_root(req)
        if spec.speculative_token_tree == DYNAMIC_TREE:
            return DynamicTree(spec.eagle_topk, spec.num_draft_tokens - 1, min(depth, slots // spec.eagle_topk + 1))
        return StaticTree(spec.speculative_token_tree, depth, slots)

    def _pass(self, chunks: list[TokenChunk], features: torch.Tensor,
              tree_rows: list[tuple[int, list[int]]] = ()) -> torch.Tensor:
        """One pass of the head over the chunks (each: the tokens at p + 1 for its positions p, its rows of
        `features` in order), writing their K/V; the head's output at each chunk's last position, in chunk order.
        `tree_rows`: for chunks that are one tree node's pass each (its token at its slot), the node's position and
        the slots it must not see."""
        mb = lay_out_chunks(chunks, self.block_size)
        for row, (position, hidden_slots) in zip(mb.logit_rows, tree_rows):
            mb.positions[row] = position
            if hidden_slots:
                mb.tree_hidden_keys[row] = hidden_slots
        # lay_out_chunks puts decode-like chunks first: each chunk's rows end at its logit row
        lengths = [len(c.token_ids) for c in chunks]
        rows = torch.cat([torch.arange(end - n + 1, end + 1) for end, n in zip(mb.logit_rows, lengths)])
        device = self.runner.device
        laid_out = torch.empty_like(features)
        laid_out[rows.to(device)] = features
        input_ids, positions = (torch.tensor(v, dtype=torch.long, device=device) for v in (mb.input_ids, mb.positions))
        meta = self.head.attention.backend.build_metadata(mb.slot_mapping, mb.decodes, mb.prefills,
                                                          mb.tree_hidden_keys)
        out = self.head(self.target.embed_tokens(input_ids), laid_out, positions, meta)
        return out[torch.tensor(mb.logit_rows, dtype=torch.long, device=device)]
