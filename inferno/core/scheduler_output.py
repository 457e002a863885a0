"""What the scheduler decided for one step, and what the model runner produced for it."""
from dataclasses import dataclass, field

from inferno.request import Request


@dataclass(slots=True)
class SchedulerOutput:
    requests: list[Request]  # in scheduling order; the model runner arranges the flat batch
    num_scheduled_tokens: list[int]  # parallel to `requests`
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) copy-on-write
    # request id -> draft tokens scheduled after its last token (speculative decoding); counted in
    # num_scheduled_tokens
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


@dataclass(slots=True)
class ModelRunnerOutput:
    # request id -> new tokens, for requests whose chunk reached the end: one, or with drafts the accepted ones
    # followed by a resampled or bonus token
    sampled_token_ids: dict[str, list[int]]
    # request id -> ([1 + k] token ids, [1 + k] logprobs, rank of the sampled token)
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)
    # request id -> per prompt position: ([1 + k] token ids, [1 + k] logprobs, rank of the prompt token)
    prompt_logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)
