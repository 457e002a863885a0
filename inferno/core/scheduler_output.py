"""What the scheduler decided for one step, and what the model runner produced for it: plain data, shipped as is
to every rank. A request crosses whole once (`NewRequestData`); after that a step carries only what changed for it
(`CachedRequestData`), and the worker keeps the rest in its own per-request state."""
from dataclasses import dataclass, field

import torch

from inferno.lora_request import LoRARequest
from inferno.pooling_params import PoolingParams
from inferno.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has not seen: everything it needs to run and sample it."""
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens beyond the prompt it starts with (a forked beam's); usually none
    sampling_params: SamplingParams
    eos_token_ids: set[int]  # held back until min_tokens (empty with ignore_eos)
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None  # an embedding request: its prompt is pooled, nothing is sampled
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with (read from its path if not held)


@dataclass(slots=True)
class CachedRequestData:
    """Requests the worker already holds, scheduled again: what changed since it last saw each (parallel lists)."""
    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # appended to the request since then
    new_block_ids: list[list[int]] = field(default_factory=list)  # appended to its block table
    # the block table starts over with new_block_ids (resumed after preemption, or a shared block copied on write)
    reset_block_ids: list[bool] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # request id -> tokens to compute this step, in scheduling order
    # request id -> draft tokens scheduled after its last token (speculative decoding; counted in
    # num_scheduled_tokens), and the draft model's distributions for them ([k, vocab]; sampled requests only)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    # request id -> the parent of each of its drafts when they form a tree (core/spec_tree.py); absent: a chain
    spec_tree_parents: dict[str, list[int]] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) copy-on-write
    finished_req_ids: set[str] = field(default_factory=set)  # ended since the last step: the worker forgets them
    # structured outputs: request id -> [1 + drafts, ceil(vocab / 32)] int32 bitmasks of the tokens its grammar
    # allows where it samples (its last token, then after each draft token); only constrained requests that sample
    grammar_bitmask: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(slots=True)
class ModelRunnerOutput:
    # request id -> new tokens, for requests whose chunk reached the end: one, or with drafts the accepted ones
    # followed by a resampled or bonus token
    sampled_token_ids: dict[str, list[int]]
    # request id -> ([1 + k] token ids, [1 + k] logprobs, rank of the sampled token)
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)
    # request id -> per prompt position: ([1 + k] token ids, [1 + k] logprobs, rank of the prompt token)
    prompt_logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)
    # request id -> the embedding of a pooling request whose prompt was completed by this step (float32, CPU)
    pooler_output: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class DraftRequest:
    """A request the speculation policy wants drafts for, after its step's output was applied (engine side)."""
    req_id: str
    num_draft_tokens: int  # at most this many
    new_token_ids: list[int]  # its tokens the worker was not sent yet (the step's emitted ones)
    num_preemptions: int  # each preemption gave its blocks away, and with them the draft K/V written there
    tree: bool = False  # drafts as a tree (speculative_token_tree) up to num_draft_tokens deep, not a chain


@dataclass(slots=True)
class DraftOutput:
    """What rank 0's proposer returns: request id -> drafts (fewer than asked, or none, where the n-gram found no
    match or the reserved KV slots end), and the draft model's distributions for them ([k, vocab], on the CPU;
    sampled requests only)."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    spec_tree_parents: dict[str, list[int]] = field(default_factory=dict)  # drafts that form a tree: their parents
