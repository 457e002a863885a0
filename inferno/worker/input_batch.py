"""One step's flat batches, planned on rank 0 from the schedule.

`StepInput` is what every rank needs to run the step's forward passes: plain lists, no Request objects, so it
pickles small when rank 0 broadcasts it. `StepPlan` adds what only rank 0 needs to sample afterwards.
"""
from dataclasses import dataclass

from inferno.engine.kv_cache_manager import cdiv
from inferno.engine.scheduler_output import SchedulerOutput
from inferno.request import Request


@dataclass(slots=True)
class MicroBatch:
    """One flat batch: decode tokens first (shortest context first), then prefill chunks."""
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]  # where each token's K/V goes
    decodes: list[tuple[int, list[int]]]  # per decode token: (sequence length, block ids it reads)
    prefills: list[tuple[int, int, list[int]]]  # per prefill chunk: (tokens, tokens already cached, block ids)
    logit_rows: list[int]  # tokens whose final hidden states become logits (sampling, prompt logprobs)


@dataclass(slots=True)
class StepInput:
    micro_batches: list[MicroBatch]  # one, or with pipeline parallelism up to one per stage
    block_copies: list[tuple[int, int]]  # (source, destination) KV blocks to copy first (copy-on-write)

    @property
    def num_logit_rows(self) -> int:
        return sum(len(mb.logit_rows) for mb in self.micro_batches)


@dataclass(slots=True)
class StepPlan:
    step: StepInput
    # indices into the step's logits (all micro-batches' logit rows, in order)
    sample_requests: list[Request]
    sample_rows: list[int]
    prompt_logprob_rows: list[tuple[Request, list[int], list[int]]]  # (request, logit rows, prompt tokens scored)


Piece = tuple[Request, int, int]  # a request, the position of its first scheduled token, the number of tokens


def plan_step(sched: SchedulerOutput, block_size: int, num_micro_batches: int = 1) -> StepPlan:
    """Split the scheduled requests into up to `num_micro_batches` batches of similar token counts and lay each
    out flat. A request scheduled alone is cut into consecutive pieces instead, one per micro-batch: every stage runs
    the micro-batches in order, so each piece finds the K/V of the pieces before it in the cache."""
    scheduled = [(req, req.num_computed_tokens, n) for req, n in zip(sched.requests, sched.num_scheduled_tokens)]
    if len(scheduled) == 1:
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
        # decodes first, shortest first (so each attention group pads little), then prefill chunks
        group.sort(key=lambda piece: (piece[2] > 1, piece[0].num_tokens))
        plan.step.micro_batches.append(_lay_out(group, block_size, plan))
    return plan


def _lay_out(group: list[Piece], block_size: int, plan: StepPlan) -> MicroBatch:
    mb = MicroBatch([], [], [], [], [], [])
    first_logit = plan.step.num_logit_rows
    for req, c, n in group:
        start = len(mb.input_ids)
        pos = range(c, c + n)
        mb.input_ids.extend(req.token_ids[c:c + n])
        mb.positions.extend(pos)
        table = req.block_ids[:cdiv(c + n, block_size)]
        mb.slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in pos)
        if n == 1:
            assert not mb.prefills, "decodes must come before prefill chunks"
            mb.decodes.append((c + 1, table))
        else:
            mb.prefills.append((n, c, table))
        if c + n == req.num_tokens:
            plan.sample_requests.append(req)
            plan.sample_rows.append(first_logit + len(mb.logit_rows))
            mb.logit_rows.append(start + n - 1)
        if req.sampling_params.prompt_logprobs is not None:
            # the logits at prompt position p score prompt token p + 1
            targets = [p for p in pos if p + 1 < req.num_prompt_tokens and p + 1 >= len(req.prompt_logprobs)]
            if targets:
                rows = list(range(first_logit + len(mb.logit_rows), first_logit + len(mb.logit_rows) + len(targets)))
                mb.logit_rows.extend(start + p - c for p in targets)
                plan.prompt_logprob_rows.append((req, rows, [req.token_ids[p + 1] for p in targets]))
    return mb
