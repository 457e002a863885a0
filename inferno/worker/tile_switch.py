"""When a model's quantized weights switch from their stored blocks to tiles (`QuantizedLinear.tile`): before its first
pass, so that every pass computes on the tiles.

The tiles' kernels do not compute the stored blocks' bits: they sum the same integers, some in another order or with
another offset (int4's, Q8's, Q6_K's: a last bit, which the next layer's int8 activations amplify), and from
`gemm_from_rows` rows the stored blocks run a dense GEMM on the dequantized weight instead. A pass on the
stored blocks, the next on tiles, gave a request other tokens depending on whether it ran in the runner's first
pass: on what came before it and with it in the batch. A switch half-way through a pass, at a moment that depends on
timing, changed tokens from run to run. So a runner makes its tiles in one place, its `TileSwitch`, never during a
pass: every pass (a step, a run of flat batches, a draft model's proposal, a Medusa proposal on the target's head, a
pass of head training) runs inside `step()`, which makes the tiles first if nothing has made them yet. An engine idle
for the warm-up's delay after start-up has them made in the background before its first pass
(`tile_between_steps`), so its first request does not wait for them.

Which layers get tiles is decided when the switch is made (`planned`), so the warm-up can look up the precompiled
decode step, whose graphs read the tiles, before they exist (worker/compile_cache.py keys it by the plan)."""
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from inferno.layers import packed_linear
from inferno.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from inferno.layers.quantization.linear import QuantizedLinear
from inferno.layers.vocab_parallel import ParallelLMHead
from inferno.worker.kv_cache import available_memory

logger = logging.getLogger("inferno")


class TileSwitch:
    """One runner's switch: `enabled` where the weights may have tiles (the CPU)."""

    def __init__(self, model: torch.nn.Module, enabled: bool):
        self.model = model
        # the layers that will run on tiles (none where their copies would not fit in memory)
        self.planned: list[QuantizedLinear] = planned_tiles(model) if enabled else []
        # and the float weights that get oneDNN copies (layers/packed_linear.py) at the same moment
        self.to_pack: list[torch.Tensor] = planned_packing(model) if enabled else []
        self.tiled = not (self.planned or self.to_pack)  # made, or given up on: nothing left to switch
        self.first_step_done = threading.Event()
        self._lock = threading.Lock()  # held by a pass over the weights, or while the tiles are made

    @contextmanager
    def step(self) -> Iterator[None]:
        """A pass over the weights, on the tiles (made here if the warm-up has not made them yet). Passes do not
        nest."""
        with self._lock:
            try:
                if not self.tiled:
                    self._tile()
                yield
            finally:
                if not self.first_step_done.is_set():  # once: Event.set takes a lock
                    self.first_step_done.set()

    @property
    def in_step(self) -> bool:
        """Whether a pass (or the tiling) holds the switch: `ModelRunner.forward` runs only inside one."""
        return self._lock.locked()

    def tile_between_steps(self, idle_wait: float) -> None:
        """The warm-up's tiling, between two passes: after `idle_wait` seconds with no pass (a pass before then has
        made them)."""
        if self.tiled:
            return
        self.first_step_done.wait(idle_wait)
        with self._lock:
            if not self.tiled:
                self._tile()

    def tiled_names(self) -> list[str]:
        """The names of the layers that run on tiles once the switch is made: the plan until then, after it the
        layers that got them (tiling may have failed)."""
        tiled = {id(m) for m in self.planned if not self.tiled or m.tiles is not None}
        return [name for name, module in self.model.named_modules() if id(module) in tiled]

    def _tile(self) -> None:
        tile_weights(self.planned)
        pack_weights(self.to_pack)
        self.tiled = True


def planned_tiles(model: torch.nn.Module) -> list[QuantizedLinear]:
    """The quantized layers that have tiles (`QuantizedLinear.can_tile`); none where the copies would take over half
    the memory available."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.can_tile]
    size = sum(m.weight.nbytes for m in layers)
    if layers and size > available_memory() // 2:
        logger.info("weights stay untiled: tiles of %.2f GiB would take over half the memory available",
                    size / 2**30)
        return []
    return layers


def planned_packing(model: torch.nn.Module) -> list[torch.Tensor]:
    """The float (bfloat16, float32) weights of the layers that compute through `packed_linear.linear`; none where
    their copies would take over half the memory available."""
    layers = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
    weights = [m.weight for m in model.modules() if isinstance(m, layers) and getattr(m, "quantized", None) is None
               and packed_linear.packable(m.weight)]
    size = sum(w.nbytes for w in weights)
    if weights and size > available_memory() // 2:
        logger.info("float weights stay unpacked: their oneDNN copies (%.2f GiB) would take over half the memory "
                    "available", size / 2**30)
        return []
    return weights


def pack_weights(weights: list[torch.Tensor]) -> None:
    """Make the oneDNN copies of `weights` (`packed_linear.pack`)."""
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            for weight in weights:
                packed_linear.pack(weight)
    except Exception:  # an optimisation: the weights not packed run plain F.linear
        logger.exception("packing the float weights for oneDNN failed")
        return
    if weights:
        logger.info("%d float weights packed for oneDNN (%.2f GiB) in %.2f s", len(weights),
                    sum(w.nbytes for w in weights) / 2**30, time.perf_counter() - start)


def tile_weights(layers: list[QuantizedLinear]) -> None:
    """Regroup `layers`' weights into tiles (`QuantizedLinear.tile`)."""
    size = sum(m.weight.nbytes for m in layers)
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            for layer in layers:
                layer.tile()
    except Exception:  # an optimisation: the layers not tiled run their stored blocks
        logger.exception("regrouping the weights into tiles failed")
        return
    logger.info("%d quantized weights regrouped into tiles (%.2f GiB) in %.2f s", len(layers), size / 2**30,
                time.perf_counter() - start)
