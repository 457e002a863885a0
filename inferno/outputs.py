"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes, and for embedding requests its
PoolingRequestOutput / EmbeddingRequestOutput."""
from dataclasses import dataclass

import torch

from inferno.core.kv_transfer import KVTransferParams


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


# one dict per position: token id -> Logprob (the chosen token plus the top-N)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    kv_transfer_params: KVTransferParams | None = None  # a prefill instance's: where the prompt's KV waits


@dataclass
class PoolingOutput:
    data: torch.Tensor  # the pooled vector (float32; empty when the request failed)


@dataclass
class PoolingRequestOutput:
    """An embedding request's result: one output, when its prompt has been computed (or it failed)."""
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt, as vLLM's."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished)
