"""The KV connector: moves a request's KV blocks, every layer's, from a prefill instance to a decode instance.

Prefill side: the engine `hold`s a finished prompt's blocks under a transfer id; a thread per paired decode
instance waits for pull requests (transfer id, first block wanted) and sends those blocks, layer by layer, then
reports the transfer finished so the engine frees them. Decode side: the engine queues `KVPull`s; a transfer
thread per prefill instance pairs with it, asks for the blocks it lacks and receives them into the blocks the
engine allocated for the request. Both threads run beside the engine's steps, their copies on one core (no OpenMP
pool of their own: `inferno/openmp.py`); the blocks they read or write belong to no running request. Results come
back through `take_finished`.

Wire format, on a pair's group: decode -> prefill [transfer id, first block]; prefill -> decode [number of
blocks, or -1 for a transfer it does not hold]; then one message of bytes (any cache dtype): per KV tensor, layer
by layer (K, V and, for a quantized cache, their scales), the blocks as a [heads, blocks, ...] tensor.
"""
import json
import logging
import math
import queue
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from inferno.core.kv_transfer import KVPull, KVTransferResult
from inferno.distributed.kv_pair import (
    DECODE_RANK, PREFILL_RANK, KVListener, connect, recv_ints, recv_tensor, send_ints, send_tensor)
from inferno.openmp import run_ops_on_this_thread

logger = logging.getLogger("inferno")

UNKNOWN_TRANSFER = -1


class KVConnector:
    def __init__(self, kv_caches: list[torch.Tensor], role: str, host: str, port: int, backend: str,
                 timeout: float):
        self.kv_caches = kv_caches  # every layer's [kv_heads, num_blocks, ...] tensors, the same order on every side
        self.role, self.backend = role, backend
        self.timeout = timedelta(seconds=timeout)
        self.layout = json.dumps([[t.shape[0], *t.shape[2:], str(t.dtype)] for t in kv_caches])
        self._lock = threading.Lock()
        self._finished: list[KVTransferResult] = []
        self._any_finished = threading.Event()  # set while `_finished` is not empty
        if role == "prefill":
            self._held: dict[int, list[int]] = {}  # transfer id -> blocks, until a decode instance pulls them
            self.listener = KVListener(host, port, backend, self.layout, timeout, self._start_serving)
        else:
            self._pulls: dict[tuple[str, int], queue.SimpleQueue[KVPull]] = {}  # per prefill instance

    def take_finished(self) -> list[KVTransferResult]:
        with self._lock:
            finished, self._finished = self._finished, []
            self._any_finished.clear()
        return finished

    def wait_for_finished(self, timeout: float) -> None:
        """Block until a transfer has ended (and is not taken yet), at most `timeout` seconds."""
        self._any_finished.wait(timeout)

    def _report(self, result: KVTransferResult) -> None:
        with self._lock:
            self._finished.append(result)
            self._any_finished.set()

    # prefill side
    def hold(self, transfer_id: int, block_ids: list[int]) -> None:
        with self._lock:
            self._held[transfer_id] = block_ids

    def release(self, transfer_id: int) -> bool:
        """Stop offering a transfer (timed out); False if a send has already taken it (it reports when done)."""
        with self._lock:
            return self._held.pop(transfer_id, None) is not None

    def _start_serving(self, group: dist.ProcessGroup) -> None:
        threading.Thread(target=self._serve, args=(group,), name="inferno-kv-send", daemon=True).start()

    def _serve(self, group: dist.ProcessGroup) -> None:
        """Answer one paired decode instance's pulls until its group breaks."""
        run_ops_on_this_thread()  # the copies beside the engine's steps: no second OpenMP pool (inferno/openmp.py)
        while True:
            try:
                transfer_id, first_block = recv_ints(group, 2, DECODE_RANK)
            except RuntimeError:
                return  # the decode instance is gone (or its group timed out): it pairs again if it comes back
            with self._lock:
                block_ids = self._held.pop(transfer_id, None)
            if block_ids is None:
                send_ints(group, [UNKNOWN_TRANSFER], DECODE_RANK, self.timeout)
                continue
            start = time.perf_counter()
            try:
                num_bytes = self._send_blocks(group, block_ids[first_block:])
            except RuntimeError as e:
                self._report(KVTransferResult(transfer_id, f"sending the KV blocks failed: {e}"))
                return
            self._report(KVTransferResult(transfer_id, None, num_bytes, time.perf_counter() - start))

    def _send_blocks(self, group: dist.ProcessGroup, block_ids: list[int]) -> int:
        send_ints(group, [len(block_ids)], DECODE_RANK, self.timeout)
        index = torch.tensor(block_ids, dtype=torch.long)
        payload = torch.cat([cache.index_select(1, index).view(torch.uint8).flatten() for cache in self.kv_caches])
        send_tensor(group, payload, DECODE_RANK, self.timeout)
        return payload.numel()

    # decode side
    def start_pull(self, pull: KVPull) -> None:
        """Queue a pull on its prefill instance's thread (a dead or slow peer holds up only its own pulls)."""
        address = (pull.host, pull.port)
        if address not in self._pulls:
            self._pulls[address] = queue.SimpleQueue()
            threading.Thread(target=self._pull_loop, args=(address,), name="inferno-kv-pull", daemon=True).start()
        self._pulls[address].put(pull)

    def _pull_loop(self, address: tuple[str, int]) -> None:
        run_ops_on_this_thread()
        group = None
        while True:
            pull = self._pulls[address].get()
            start = time.perf_counter()
            try:
                group = group or connect(*address, self.backend, self.layout, self.timeout.total_seconds())
                num_bytes = self._pull(group, pull)
            except Exception as e:  # one failed transfer fails its request, not the thread; the next one pairs again
                group = None
                self._report(KVTransferResult(pull.req_id, f"pulling the KV cache from {pull.host}:{pull.port} "
                                                           f"failed: {type(e).__name__}: {e}"))
                continue
            self._report(KVTransferResult(pull.req_id, None, num_bytes, time.perf_counter() - start))

    def _pull(self, group: dist.ProcessGroup, pull: KVPull) -> int:
        send_ints(group, [pull.transfer_id, pull.first_block], PREFILL_RANK, self.timeout)
        (num_blocks,) = recv_ints(group, 1, PREFILL_RANK, self.timeout)
        if num_blocks == UNKNOWN_TRANSFER:
            raise LookupError(f"transfer {pull.transfer_id} is not held there (timed out, or pulled already)")
        if num_blocks != len(pull.block_ids):
            raise ValueError(f"the prefill instance sends {num_blocks} blocks, {len(pull.block_ids)} expected")
        index = torch.tensor(pull.block_ids, dtype=torch.long)
        shapes = [(cache.shape[0], num_blocks, *cache.shape[2:]) for cache in self.kv_caches]
        sizes = [math.prod(shape) * cache.element_size() for shape, cache in zip(shapes, self.kv_caches)]
        payload = torch.empty(sum(sizes), dtype=torch.uint8)
        recv_tensor(group, payload, PREFILL_RANK, self.timeout)
        for cache, shape, blocks in zip(self.kv_caches, shapes, payload.split(sizes)):
            cache.index_copy_(1, index, blocks.view(cache.dtype).view(shape))
        return payload.numel()
