"""A runner's weights in the layouts its CPU kernels run fastest: quantized weights regrouped into tiles
(`QuantizedLinear.tile`), float weights given their oneDNN copies (layers/packed_linear.py); made once, when the
runner is built, before any pass over the weights.

The tiles' kernels do not compute the stored blocks' bits: they sum the same integers, some in another order or with
another offset (int4's, Q8's, Q6_K's: a last bit, which the next layer's int8 activations amplify), and from
`gemm_from_rows` rows the stored blocks run a dense GEMM on the dequantized weight instead. So every pass must run
on the tiles, the first included: a switch between two passes gave a request other tokens depending on whether it ran
in the runner's first pass, one half-way through a pass changed tokens from run to run. Made at start-up they cost
that start-up their copy (Qwen2.5-Coder-1.5B Q4_K_M: 0.91 GiB in 0.4-1 s on 2 cores), not a request: made in the
first step instead, they held the first request (and every other arriving meanwhile) for as long, and on a second core
still importing the compiler, twice as long.

The layers planned to get tiles (`planned_tiles`: none where the copies would not fit in memory) run on them from the
first pass; one whose tiling failed runs its stored blocks. The warm-up keys the precompiled decode step, whose graphs
read the tiles, by the layers that got them (`make_fast_layouts`' names; worker/compile_cache.py)."""
import logging
import time

import torch

from inferno.layers import packed_linear
from inferno.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from inferno.layers.quantization.linear import QuantizedLinear
from inferno.layers.vocab_parallel import ParallelLMHead
from inferno.worker.kv_cache import available_memory

logger = logging.getLogger("inferno")


def make_fast_layouts(model: torch.nn.Module) -> list[str]:
    """Tile the model's quantized weights and pack its float ones (where their copies fit in memory); the names of the
    layers that run on tiles."""
    layers = planned_tiles(model)
    tile_weights(layers)
    pack_weights(planned_packing(model))
    tiled = {id(m) for m in layers if m.tiles is not None}
    return [name for name, module in model.named_modules() if id(module) in tiled]


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
