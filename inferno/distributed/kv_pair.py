"""Two-rank process groups between independent inferno instances, for KV transfers.

A prefill instance listens: a TCPStore at its KV address (`--kv-host`, `--kv-port`). Each decode instance that
connects takes the next pair number from the store and both sides build a 2-rank group of their own under that
number (prefill rank 0, decode rank 1), with no default process group: an instance can pair with many peers, and
a multi-rank executor's groups are untouched. The store also carries the prefill side's KV layout, so instances
of different models (or cache dtypes) refuse to pair instead of exchanging garbage.

Groups wait for their next message as long as their peer lives; a transfer's own waits are bounded
(`Work.wait(timeout)`). A timed-out or broken group is dropped, and the peers pair again on the next transfer.
"""
import logging
import socket
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger("inferno")

IDLE_TIMEOUT = timedelta(days=365)  # a paired group waits this long for its next message
PREFILL_RANK, DECODE_RANK = 0, 1


def pair_group(backend: str, store: dist.Store, pair: int, rank: int, local_host: str) -> dist.ProcessGroup:
    """The 2-rank group of pair number `pair`, this side being `rank`, reachable at `local_host`."""
    if backend != "gloo":
        raise ValueError(f"kv_transfer_backend {backend!r} is not supported; use 'gloo'")
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    options._timeout = IDLE_TIMEOUT
    return dist.ProcessGroupGloo(dist.PrefixStore(f"pair/{pair}/", store), rank, 2, options)


class KVListener:
    """Prefill side: pairs with every decode instance that connects and hands each group to `on_peer`."""

    def __init__(self, host: str, port: int, backend: str, layout: str, timeout: float,
                 on_peer: Callable[[dist.ProcessGroup], None]):
        self.host, self.backend, self.on_peer = host, backend, on_peer
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout))
        self.store.set("layout", layout)
        threading.Thread(target=self._accept, name="inferno-kv-listener", daemon=True).start()

    def _accept(self) -> None:
        pair = 0
        while True:
            self.store.wait([f"peer/{pair}"], IDLE_TIMEOUT)
            try:
                group = pair_group(self.backend, self.store, pair, PREFILL_RANK, self.host)
            except Exception:  # the decode instance went away while pairing: the next one gets the next number
                logger.exception("KV transfer: pairing with decode peer %d failed", pair)
            else:
                self.on_peer(group)
            pair += 1


def connect(host: str, port: int, backend: str, layout: str, timeout: float) -> dist.ProcessGroup:
    """Decode side: pair with the prefill instance listening at (host, port)."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    remote_layout = store.get("layout").decode()
    if remote_layout != layout:
        raise ValueError(f"the prefill instance at {host}:{port} holds a different KV layout ({remote_layout}) "
                         f"than this one ({layout}): serve the same model, block size and kv_cache_dtype on both")
    pair = store.add("peers", 1) - 1
    store.set(f"peer/{pair}", "")
    return pair_group(backend, store, pair, DECODE_RANK, local_address_towards(host, port))


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to (host, port): where the peer can reach us."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


def send_ints(group: dist.ProcessGroup, values: list[int], peer: int, timeout: timedelta) -> None:
    group.send([torch.tensor(values, dtype=torch.long)], peer, 0).wait(timeout)


def recv_ints(group: dist.ProcessGroup, count: int, peer: int, timeout: timedelta | None = None) -> list[int]:
    """`count` integers from `peer`; with no timeout, as long as the group waits (the peer's next request)."""
    values = torch.empty(count, dtype=torch.long)
    work = group.recv([values], peer, 0)
    work.wait() if timeout is None else work.wait(timeout)
    return values.tolist()


def send_tensor(group: dist.ProcessGroup, tensor: torch.Tensor, peer: int, timeout: timedelta) -> None:
    group.send([tensor.contiguous()], peer, 0).wait(timeout)


def recv_tensor(group: dist.ProcessGroup, tensor: torch.Tensor, peer: int, timeout: timedelta) -> None:
    group.recv([tensor], peer, 0).wait(timeout)
