"""Disaggregated prefill and decode, as plain data: what a request carries between a prefill instance, which
computes its prompt and first token, and a decode instance, which pulls that KV cache and goes on decoding; and
what the worker's KV connector reports of each transfer."""
from dataclasses import dataclass

KV_ROLES = ("prefill", "decode")
KV_TRANSFER_FALLBACKS = ("recompute", "error")
KV_TRANSFER_BACKENDS = ("gloo",)  # CPU tensors; NCCL belongs with a CUDA model path


@dataclass(slots=True, frozen=True)
class KVTransferParams:
    """vLLM's `kv_transfer_params`. To a prefill instance: `do_remote_decode` (hold the prompt's blocks for a
    decode instance). From it, and then to a decode instance: where the prompt's KV waits (`remote_host`,
    `remote_port`, `transfer_id`), how many prompt tokens it covers and the first token sampled after them."""
    do_remote_decode: bool = False
    remote_host: str | None = None
    remote_port: int | None = None
    transfer_id: int | None = None
    num_prompt_tokens: int | None = None
    first_token_id: int | None = None

    def __post_init__(self) -> None:
        remote = (self.remote_host, self.remote_port, self.transfer_id, self.num_prompt_tokens, self.first_token_id)
        if any(v is not None for v in remote) and not all(v is not None for v in remote):
            raise ValueError("kv_transfer_params must give all of remote_host, remote_port, transfer_id, "
                             "num_prompt_tokens and first_token_id (the prefill instance's answer), or none")
        if self.do_remote_decode and self.is_remote_prefill:
            raise ValueError("kv_transfer_params cannot both ask for a remote decode and bring a remote prefill")

    @property
    def is_remote_prefill(self) -> bool:
        """The prompt was computed elsewhere: pull its KV instead of computing it."""
        return self.transfer_id is not None


@dataclass(slots=True)
class KVPull:
    """Decode side: copy blocks `first_block`.. of a prefill instance's held transfer into `block_ids`."""
    req_id: str
    host: str
    port: int
    transfer_id: int
    first_block: int
    block_ids: list[int]


@dataclass(slots=True)
class KVTransferResult:
    """One finished transfer: a pull (decode side, keyed by request id) or a send (prefill side, transfer id)."""
    key: str | int
    error: str | None  # None: every block arrived
    num_bytes: int = 0
    seconds: float = 0.0
