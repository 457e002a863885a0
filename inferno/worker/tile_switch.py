"""When a model's quantized weights switch from their stored blocks to tiles (`QuantizedLinear.tile`).

The tiles' kernels sum the same integers, some in another order (int4's, Q8's, Q6_K's), so they can round
differently in the last bit, which the next layer's int8 activations amplify: a switch at a moment that depends on
timing (between two layers of a pass, or before one step in one run and after it in another) changed tokens from
run to run. So a runner switches at one place, its `TileSwitch`, and only between two passes over its weights:
every pass (a step, a run of flat batches, a draft model's proposal, a Medusa proposal on the target's head, a pass
of head training) runs inside `step()`, the first one on the stored blocks and every later one on the tiles, made by
the warm-up in the background between them or, if it has not got to them yet, at the start of the second pass. An
engine idle for the warm-up's delay after start-up has them made before its first pass (`tile_between_steps`).

Which layers get tiles is decided when the switch is made (`planned`), so the warm-up can look up the precompiled
decode step, whose graphs read the tiles, before they exist (worker/compile_cache.py keys it by the plan)."""
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from inferno.layers.quantization.linear import QuantizedLinear
from inferno.worker.kv_cache import available_memory

logger = logging.getLogger("inferno")


class TileSwitch:
    """One runner's switch: `enabled` where the weights may have tiles (the CPU)."""

    def __init__(self, model: torch.nn.Module, enabled: bool):
        self.model = model
        # the layers that will run on tiles (none where their copies would not fit in memory)
        self.planned: list[QuantizedLinear] = planned_tiles(model) if enabled else []
        self.tiled = not self.planned  # tiles made, or given up on: nothing left to switch
        self.first_step_done = threading.Event()
        self._lock = threading.Lock()  # held by a pass over the weights, or while the tiles are made

    @contextmanager
    def step(self) -> Iterator[None]:
        """A pass over the weights: on the stored blocks if it is the runner's first, else on the tiles (made here
        if the warm-up has not made them yet). Passes do not nest."""
        with self._lock:
            try:
                if not self.tiled and self.first_step_done.is_set():
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
        """The warm-up's tiling: once the first pass is over (or after `idle_wait` seconds with none), between two
        passes."""
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
