"""One step's flat batches, planned by every rank alike from the schedule and its own request states.

`StepInput` is what a rank needs to run the step's forward passes: plain lists. `StepPlan` adds what rank 0
needs to sample afterwards.
"""
from dataclasses import dataclass, field

from inferno.core.kv_blocks import cdiv
from inferno.core.scheduler_output import SchedulerOutput
from inferno.core.spec_tree import SpecTree
import torch

from inferno.worker.pooler import PoolingChunk, kv_read_later, pooled_positions
from inferno.worker.request_state import CachedRequestState

MAX_DECODE_ROWS_PER_CHUNK = 16  # chunks after the prompt up to this long attend as decode rows


@dataclass(slots=True)
class TokenChunk:
    """Tokens of one sequence to run: `token_ids` at positions start.. (start = tokens already in the cache)."""
    token_ids: list[int]
    start: int
    block_ids: list[int]
    lora_int_id: int = 0  # the LoRA adapter its tokens run with (0: none)
    tree: SpecTree | None = None  # its last tokens are a tree of drafts under its last real token
    writes_kv: bool = True  # False: a prompt computed whole whose K/V no later step reads (an embedding's)
    prompt_end: int = 0  # the sequence's prompt tokens (positions below it); 0: not told

    @property
    def as_decode_rows(self) -> bool:
        """A decode, or a few tokens after the prompt over cached context (a decode with drafts to verify, a tree of
        them): one decode row per token, each attending up to its own position (a tree's nodes: up to their own slot,
        but for the other branches'). A prompt's tokens always run the prefill kernel, which computes other bits than
        the decode kernel: were the tail of a chunked prompt or of a prefix-cache hit decode rows, a prompt's output
        would depend on how the batch chunked it."""
        n = len(self.token_ids)
        return self.tree is not None or (self.start >= self.prompt_end
                                         and (n == 1 or (self.start > 0 and n <= MAX_DECODE_ROWS_PER_CHUNK)))

    def positions_and_hidden_keys(self) -> tuple[list[int], dict[int, list[int]]]:
        """Each token's position (a tree node's: its root's plus its depth) and, per token of a tree, the earlier
        slots of the chunk it must not see (by their index in the chunk). Slots follow the layout: token i's K/V
        goes to the sequence's slot start + i."""
        c, n = self.start, len(self.token_ids)
        if self.tree is None:
            return list(range(c, c + n)), {}
        root = n - self.tree.num_nodes
        positions = list(range(c, c + root)) + [c + root + depth for depth in self.tree.depths()]
        hidden = {root + node: [root + other for other in self.tree.hidden_nodes(node)]
                  for node in range(2, self.tree.num_nodes)}
        return positions, {i: keys for i, keys in hidden.items() if keys}

    @property
    def batch_order(self) -> tuple[bool, bool, int]:
        """Where the chunk goes in a flat batch: decode rows first, shortest context first (so each attention group
        pads little), then prefill chunks, those that write no K/V last (the written rows are a prefix)."""
        return not self.as_decode_rows, not self.writes_kv, self.start


@dataclass(slots=True)
class MicroBatch:
    """One flat batch: decode tokens first (shortest context first), then prefill chunks."""
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]  # where each token's K/V goes: the first len(slot_mapping) tokens, the others write none
    decodes: list[tuple[int, list[int]]]  # per decode token: (sequence length, block ids it reads)
    prefills: list[tuple[int, int, list[int]]]  # per prefill chunk: (tokens, tokens already cached, block ids)
    logit_rows: list[int]  # tokens whose final hidden states become logits (sampling, prompt logprobs)
    pooling_rows: list[int] = field(default_factory=list)  # tokens whose final hidden states are pooled (embeddings)
    lora_ids: list[int] = field(default_factory=list)  # per token, the LoRA adapter it runs with (0: none)
    # per scheduled chunk: (request id, its first row, its first position, its tokens, drafts included)
    request_rows: list[tuple[str, int, int, int]] = field(default_factory=list)
    # tree drafts: decode row -> the positions (cache slots of its sequence) before it that it must not see
    tree_hidden_keys: dict[int, list[int]] = field(default_factory=dict)

    @property
    def output_rows(self) -> list[int]:
        """The tokens whose final hidden states the step needs: logit rows, then pooling rows."""
        return self.logit_rows + self.pooling_rows


@dataclass(slots=True)
class StepInput:
    micro_batches: list[MicroBatch]  # one, or with pipeline parallelism up to one per stage
    block_copies: list[tuple[int, int]]  # (source, destination) KV blocks to copy first (copy-on-write)

    @property
    def num_logit_rows(self) -> int:
        return sum(len(mb.logit_rows) for mb in self.micro_batches)

    @property
    def num_pooling_rows(self) -> int:
        return sum(len(mb.pooling_rows) for mb in self.micro_batches)


@dataclass(slots=True)
class StepPlan:
    step: StepInput
    # indices into the step's logits (all micro-batches' logit rows, in order)
    sample_requests: list[CachedRequestState]
    sample_rows: list[int]
    # (request, logit rows, prompt tokens scored)
    prompt_logprob_rows: list[tuple[CachedRequestState, list[int], list[int]]]
    # speculative decoding: requests whose drafts are verified, their drafts, the draft model's distributions for
    # them, and the logit rows of all 1 + k positions of each (consecutive)
    spec_requests: list[CachedRequestState] = field(default_factory=list)
    spec_token_ids: list[list[int]] = field(default_factory=list)
    spec_draft_probs: list[torch.Tensor | None] = field(default_factory=list)
    spec_rows: list[int] = field(default_factory=list)
    spec_trees: list[SpecTree | None] = field(default_factory=list)  # per speculating request (None: a chain)
    pooling: list[PoolingChunk] = field(default_factory=list)  # embedding requests' chunks (rank 0 pools them)


def plan_step(sched: SchedulerOutput, states: dict[str, CachedRequestState], block_size: int,
              num_micro_batches: int = 1, skip_unread_kv: bool = False, prefix_caching: bool = True) -> StepPlan:
    """Split the scheduled requests into up to `num_micro_batches` batches of similar token counts and lay each
    out flat. A request scheduled alone (without drafts) is cut into consecutive pieces instead, one per
    micro-batch: every stage runs the micro-batches in order, so each piece finds the K/V of the pieces before it in
    the cache. A request's draft tokens (speculative decoding) follow its last token. `skip_unread_kv` (an attention
    backend whose prefill reads a chunk's own K/V as computed): an embedding prompt computed whole writes no K/V
    unless the prefix cache keeps it (`prefix_caching`: the engine's)."""
    scheduled = [(states[rid], states[rid].num_computed_tokens, n) for rid, n in sched.num_scheduled_tokens.items()]
    if len(scheduled) == 1 and not sched.spec_token_ids:
        req, c, n = scheduled[0]
        parts = min(num_micro_batches, n)
        groups = [[(req, c + n * i // parts, n * (i + 1) // parts - n * i // parts)] for i in range(parts)]
    else:
        groups = [[] for _ in range(min(num_micro_batches, len(scheduled)))]
        loads = [0] * len(groups)
        for piece in sorted(scheduled, key=lambda piece: -piece[2]):
            lightest = loads.index(min(loads))
            groups[lightest].append(piece)
            loads[lightest] += piece[2]
    plan = StepPlan(StepInput([], sched.block_copies), [], [], [])
    for group in groups:
        chunks = [(req, TokenChunk((req.token_ids + sched.spec_token_ids.get(req.request_id, []))[c:c + n], c,
                                   req.block_ids, req.lora_int_id, _tree(sched, req.request_id),
                                   prompt_end=req.num_prompt_tokens))
                  for req, c, n in group]
        for req, chunk in chunks:
            if skip_unread_kv and req.pooling_params is not None and not chunk.as_decode_rows:
                chunk.writes_kv = kv_read_later(req.pooling_params, chunk.start, len(chunk.token_ids),
                                                req.num_prompt_tokens, prefix_caching)
        chunks.sort(key=lambda rc: rc[1].batch_order)
        plan.step.micro_batches.append(_lay_out(chunks, sched, block_size, plan))
    return plan


def _tree(sched: SchedulerOutput, request_id: str) -> SpecTree | None:
    parents = sched.spec_tree_parents.get(request_id)
    return None if parents is None else SpecTree(tuple(parents))


def lay_out_chunks(chunks: list[TokenChunk], block_size: int) -> MicroBatch:
    """One flat batch of `chunks` whose logit rows are the last token of each chunk, in the order given."""
    mb = MicroBatch([], [], [], [], [], [])
    starts = [0] * len(chunks)
    for i in sorted(range(len(chunks)), key=lambda i: chunks[i].batch_order):
        starts[i] = _append(mb, chunks[i], block_size)
    mb.logit_rows = [start + len(chunk.token_ids) - 1 for chunk, start in zip(chunks, starts)]
    return mb


def _append(mb: MicroBatch, chunk: TokenChunk, block_size: int) -> int:
    """Add a chunk's tokens to the flat batch; returns where they start in it."""
    start, c, n = len(mb.input_ids), chunk.start, len(chunk.token_ids)
    pos = range(c, c + n)  # the sequence's slots the tokens fill (their positions too, but for a tree's)
    positions, hidden_keys = chunk.positions_and_hidden_keys()
    mb.input_ids.extend(chunk.token_ids)
    mb.positions.extend(positions)
    mb.tree_hidden_keys.update({start + i: [c + key for key in keys] for i, keys in hidden_keys.items()})
    mb.lora_ids.extend([chunk.lora_int_id] * n)
    table = chunk.block_ids[:cdiv(c + n, block_size)]
    if chunk.writes_kv:
        assert len(mb.slot_mapping) == start, "the rows that write K/V must come first"
        mb.slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in pos)
    if chunk.as_decode_rows:
        assert not mb.prefills, "decodes must come before prefill chunks"
        mb.decodes.extend((p + 1, table[:cdiv(p + 1, block_size)]) for p in pos)
    else:
        mb.prefills.append((n, c, table))
    return start


def _lay_out(chunks: list[tuple[CachedRequestState, TokenChunk]], sched: SchedulerOutput, block_size: int,
             plan: StepPlan) -> MicroBatch:
    mb = MicroBatch([], [], [], [], [], [])
    first_logit, first_pooled = plan.step.num_logit_rows, plan.step.num_pooling_rows
    for req, chunk in chunks:
        start = _append(mb, chunk, block_size)
        c, n = chunk.start, len(chunk.token_ids)
        mb.request_rows.append((req.request_id, start, c, n))
        drafts = sched.spec_token_ids.get(req.request_id)
        if req.pooling_params is not None:
            positions = pooled_positions(req.pooling_params, c, n, req.num_prompt_tokens)
            row = first_pooled + len(mb.pooling_rows)
            plan.pooling.append(PoolingChunk(req, range(row, row + len(positions)), c, c + n == req.num_tokens))
            mb.pooling_rows.extend(start + p - c for p in positions)
        elif drafts:  # the target's distributions at the last token and after every draft
            plan.spec_requests.append(req)
            plan.spec_token_ids.append(drafts)
            plan.spec_draft_probs.append(sched.draft_probs.get(req.request_id))
            plan.spec_trees.append(chunk.tree)
            plan.spec_rows.extend(range(first_logit + len(mb.logit_rows), first_logit + len(mb.logit_rows) + n))
            mb.logit_rows.extend(range(start, start + n))
        elif c + n == req.num_tokens:
            plan.sample_requests.append(req)
            plan.sample_rows.append(first_logit + len(mb.logit_rows))
            mb.logit_rows.append(start + n - 1)
        if req.sampling_params.prompt_logprobs is not None:
            # the logits at prompt position p score prompt token p + 1
            targets = [p for p in range(c, c + n) if p + 1 < req.num_prompt_tokens and p + 1 >= req.num_prompt_logprobs]
            req.num_prompt_logprobs += len(targets)
            if targets:
                rows = list(range(first_logit + len(mb.logit_rows), first_logit + len(mb.logit_rows) + len(targets)))
                mb.logit_rows.extend(start + p - c for p in targets)
                plan.prompt_logprob_rows.append((req, rows, [req.token_ids[p + 1] for p in targets]))
    return mb
