"""The worker's own record of each request it runs, kept between steps from the scheduler's plain data."""
from dataclasses import dataclass

import torch

from inferno.core.scheduler_output import NewRequestData, SchedulerOutput
from inferno.core.token_counts import TokenCounts
from inferno.lora_request import LoRARequest
from inferno.pooling_params import PoolingParams
from inferno.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState(TokenCounts):
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt + output, as the engine kept them
    sampling_params: SamplingParams
    eos_token_ids: set[int]
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None  # seeded requests: every random draw of the request, in order
    num_prompt_logprobs: int  # prompt positions scored so far (the first one, which has no logprob, counts)
    pooling_params: PoolingParams | None = None  # an embedding request (worker/pooler.py)
    pooled: torch.Tensor | None = None  # rank 0: what its pooling has gathered from the chunks computed so far
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with
    prompt_tokens: torch.Tensor | None = None  # distinct_prompt_tokens, once a step has needed them

    @property
    def lora_int_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    def distinct_prompt_tokens(self) -> torch.Tensor:
        """The prompt's distinct token ids, sorted (what the penalties look up), found at the first call."""
        if self.prompt_tokens is None:
            self.prompt_tokens = torch.tensor(self.prompt_token_ids, dtype=torch.long).unique()
        return self.prompt_tokens

    @classmethod
    def from_new(cls, data: NewRequestData, device: torch.device) -> "CachedRequestState":
        params = data.sampling_params
        generator = torch.Generator(device).manual_seed(params.seed) if params.seed is not None else None
        return cls(data.req_id, list(data.prompt_token_ids), data.prompt_token_ids + data.output_token_ids, params,
                   data.eos_token_ids, list(data.block_ids), data.num_computed_tokens, generator,
                   int(params.prompt_logprobs is not None), data.pooling_params, lora_request=data.lora_request)


def update_states(states: dict[str, CachedRequestState], sched: SchedulerOutput,
                  device: torch.device = torch.device("cpu")) -> None:
    """Bring the worker's requests up to the step: drop finished ones, add new ones, apply the changes."""
    for rid in sched.finished_req_ids:
        states.pop(rid, None)
    for data in sched.scheduled_new_reqs:
        states[data.req_id] = CachedRequestState.from_new(data, device)
    cached = sched.scheduled_cached_reqs
    for rid, tokens, blocks, reset, num_computed in zip(cached.req_ids, cached.new_token_ids, cached.new_block_ids,
                                                        cached.reset_block_ids, cached.num_computed_tokens):
        state = states[rid]
        state.token_ids.extend(tokens)
        state.block_ids = list(blocks) if reset else state.block_ids + blocks
        state.num_computed_tokens = num_computed
