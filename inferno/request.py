"""A request as the engine tracks it: tokens, progress, KV blocks, sampling state."""
import enum
import time

import torch

from inferno.core.kv_blocks import BlockHash
from inferno.core.kv_transfer import KVTransferParams
from inferno.core.token_counts import TokenCounts
from inferno.lora_request import LoRARequest
from inferno.outputs import PositionLogprobs, RequestMetrics
from inferno.pooling_params import PoolingParams
from inferno.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request(TokenCounts):
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: set[int], max_model_len: int, arrival_time: float | None = None,
                 beam_search_id: str | None = None, pooling_params: PoolingParams | None = None,
                 lora_request: LoRARequest | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.sampling_params = sampling_params
        self.eos_token_ids = set() if sampling_params.ignore_eos else eos_token_ids
        max_tokens = sampling_params.max_tokens or max_model_len
        self.max_tokens = min(max_tokens, max_model_len - len(prompt_token_ids))
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[BlockHash] = []  # prefix-cache identity of each full block of token_ids
        self.num_cached_blocks = 0  # leading blocks already registered in the prefix cache
        # leading blocks freed because no later query can see them (sliding-window models); their ids stay in
        # block_ids so positions line up, but this request no longer holds them
        self.num_dropped_blocks = 0
        self.beam_search_id = beam_search_id  # a beam's search picks its next token, not the scheduler
        # speculative decoding: draft tokens for the next step (not part of token_ids until accepted) and the
        # proposer's distributions for them ([k, vocab]; None for n-gram drafts and greedy requests)
        self.spec_token_ids: list[int] = []
        self.draft_probs: torch.Tensor | None = None
        self.spec_tree_parents: list[int] | None = None  # its drafts' parents when they form a tree
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.cumulative_logprob = 0.0
        self.logprobs: list[PositionLogprobs] = []
        self.prompt_logprobs: list[PositionLogprobs | None] = [None] if sampling_params.prompt_logprobs is not None else []
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        # disaggregated prefill/decode: where this request's prompt KV waits (decode side, until it arrives), and
        # where it left it for a decode instance (prefill side, once finished)
        self.remote_prefill: KVTransferParams | None = None
        self.kv_transfer_params: KVTransferParams | None = None
        # an embedding request: it computes its prompt, then ends with the pooled vector (it samples nothing, and
        # its sampling_params switch every sampling feature off)
        self.pooling_params = pooling_params
        self.pooled: torch.Tensor | None = None
        self.lora_request = lora_request  # the LoRA adapter it runs with

    @property
    def lora_int_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
