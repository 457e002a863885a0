"""What the scheduler decided for one step, and what the model runner produced for it."""
from dataclasses import dataclass, field

import torch

from inferno.request import Request


@dataclass(slots=True)
class SchedulerOutput:
    requests: list[Request]  # in scheduling order; the model runner arranges the flat batch
    num_scheduled_tokens: list[int]  # parallel to `requests`
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) copy-on-write

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]  # request id -> new token, for requests whose chunk reached the end
    # request id -> ([1 + k] token ids, [1 + k] logprobs, rank of the sampled token)
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)
    # request id -> per prompt position: ([1 + k] token ids, [1 + k] logprobs, rank of the prompt token)
    prompt_logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)
