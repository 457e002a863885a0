"""The engine's side of disaggregated prefill and decode: which blocks are held or awaited, and for how long.

Prefill instance: a request sent with `do_remote_decode` runs as usual (its prompt and first token); when it
finishes, its prompt's blocks are not freed but held under a fresh transfer id, and its output says where they
are (`kv_transfer_params`). They are freed once a decode instance has pulled them, when the send fails, or after
`kv_transfer_timeout` seconds.

Decode instance: a request that brings those params is admitted with blocks for its prompt (after its own
prefix-cache hits), then waits off the running batch while the worker's connector pulls the missing blocks; the
engine keeps stepping the other requests. When the blocks have arrived, the prompt counts as computed and the
prefill's first token is appended; if the pull fails, the prompt is computed here instead ("recompute") or the
request fails ("error"). Blocks a pull writes into are freed only once the pull is over, even if the request was
aborted meanwhile.
"""
import logging
import secrets
import time
from dataclasses import dataclass, field

from inferno.config import EngineConfig
from inferno.core.kv_blocks import cdiv
from inferno.core.kv_transfer import KVPull, KVTransferParams, KVTransferResult
from inferno.engine.kv_cache_manager import KVCacheManager
from inferno.request import Request, RequestStatus
from inferno.sampling_params import SamplingParams

logger = logging.getLogger("inferno")


@dataclass(slots=True)
class KVTransferStats:
    """Since the engine started: bytes moved and transfers failed; durations not yet handed to a stat logger."""
    num_bytes: int = 0
    num_failures: int = 0
    new_seconds: list[float] = field(default_factory=list)


@dataclass(slots=True)
class HeldBlocks:
    block_ids: list[int]
    deadline: float  # time.monotonic() after which nobody may pull them any more


class KVTransferManager:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager, connector, vocab_size: int):
        self.role = config.kv_role
        self.host, self.port = config.kv_host, config.kv_port
        self.timeout = config.kv_transfer_timeout
        self.fallback = config.kv_transfer_fallback
        self.kv_cache_manager = kv_cache_manager
        self.connector = connector  # the worker's KVConnector, through the executor
        self.vocab_size = vocab_size
        self.held: dict[int, HeldBlocks] = {}  # prefill: transfer id -> blocks waiting to be pulled
        self.pulling: dict[str, Request] = {}  # decode: request id -> request whose KV is on its way
        self.stats = KVTransferStats()

    @property
    def has_pending(self) -> bool:
        return bool(self.held or self.pulling)

    def check(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """ValueError for kv_transfer_params this instance cannot honour."""
        kv = params.kv_transfer_params
        if kv.do_remote_decode and self.role != "prefill":
            raise ValueError("kv_transfer_params asks for a remote decode, but this instance is not a prefill "
                             "instance (start it with --kv-role prefill)")
        if kv.is_remote_prefill:
            if self.role != "decode":
                raise ValueError("kv_transfer_params brings a remote prefill, but this instance is not a decode "
                                 "instance (start it with --kv-role decode)")
            if kv.num_prompt_tokens != num_prompt_tokens:
                raise ValueError(f"kv_transfer_params covers {kv.num_prompt_tokens} prompt tokens but the prompt has "
                                 f"{num_prompt_tokens}: the prefill instance computed a different prompt")
            if not 0 <= kv.first_token_id < self.vocab_size:
                raise ValueError(f"kv_transfer_params first_token_id {kv.first_token_id} is out of range for "
                                 f"vocabulary size {self.vocab_size}")
        one_sample = params.n == 1 or not kv.do_remote_decode
        if not one_sample or params.use_beam_search or params.prompt_logprobs is not None:
            raise ValueError("kv_transfer_params works with one sample (n = 1 on the prefill instance), without "
                             "beam search or prompt_logprobs")

    # prefill side
    def wants_hold(self, req: Request) -> bool:
        """A remote-decode request that finished its first token: its prompt's KV waits for a decode instance."""
        kv = req.sampling_params.kv_transfer_params
        return (kv is not None and kv.do_remote_decode and req.num_output_tokens > 0
                and req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH))

    def hold(self, req: Request) -> None:
        """Keep the blocks of the prompt (the rest go back) and tell the request's output where they are."""
        num_blocks = cdiv(req.num_prompt_tokens, self.kv_cache_manager.block_size)
        block_ids = self.kv_cache_manager.take_blocks(req, num_blocks)
        transfer_id = secrets.randbits(63)
        self.held[transfer_id] = HeldBlocks(block_ids, time.monotonic() + self.timeout)
        self.connector.hold(transfer_id, block_ids)
        req.kv_transfer_params = KVTransferParams(
            remote_host=self.host, remote_port=self.port, transfer_id=transfer_id,
            num_prompt_tokens=req.num_prompt_tokens, first_token_id=req.output_token_ids[0])

    # decode side
    def start_pull(self, req: Request, num_hit_blocks: int) -> None:
        """Pull the prompt's blocks after the first `num_hit_blocks` (found in this instance's prefix cache)."""
        kv = req.remote_prefill
        num_blocks = cdiv(req.num_prompt_tokens, self.kv_cache_manager.block_size)
        self.pulling[req.request_id] = req
        self.connector.start_pull(KVPull(req.request_id, kv.remote_host, kv.remote_port, kv.transfer_id,
                                         num_hit_blocks, req.block_ids[num_hit_blocks:num_blocks]))

    def is_pulling(self, req: Request) -> bool:
        return req.request_id in self.pulling

    # both
    def poll(self) -> list[tuple[Request, str | None]]:
        """Account for finished transfers and expired holds; returns the live requests whose pull ended (with its
        error, None when the KV arrived)."""
        ended = []
        for result in self.connector.take_finished():
            self._record(result)
            if self.role == "prefill":
                self._free_held(result.key)
                continue
            req = self.pulling.pop(result.key)
            if req.is_finished:  # aborted while its blocks were being written
                self.kv_cache_manager.free(req)
            else:
                ended.append((req, result.error))
        now = time.monotonic()
        for transfer_id in [t for t, held in self.held.items() if held.deadline < now]:
            if self.connector.release(transfer_id):  # not being sent: nobody pulled it in time
                self._record(KVTransferResult(transfer_id, f"not pulled within {self.timeout} s"))
                self._free_held(transfer_id)
        return ended

    def wait(self, timeout: float) -> None:
        """Block until a transfer ends, `timeout` seconds pass, or a hold expires, whichever comes first."""
        if self.held:
            first_deadline = min(held.deadline for held in self.held.values())
            timeout = max(0.0, min(timeout, first_deadline - time.monotonic()))
        self.connector.wait_for_finished(timeout)

    def _free_held(self, transfer_id: int) -> None:
        self.kv_cache_manager.free_blocks(self.held.pop(transfer_id).block_ids)

    def _record(self, result: KVTransferResult) -> None:
        if result.error is None:
            self.stats.num_bytes += result.num_bytes
            self.stats.new_seconds.append(result.seconds)
        else:
            self.stats.num_failures += 1
            logger.warning("KV transfer %s failed: %s", result.key, result.error)

    def take_stats(self) -> KVTransferStats:
        """The running totals, and the durations since the last call."""
        stats = KVTransferStats(self.stats.num_bytes, self.stats.num_failures, self.stats.new_seconds)
        self.stats.new_seconds = []
        return stats
