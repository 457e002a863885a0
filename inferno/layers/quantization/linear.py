"""`QuantizedLinear`: what every quantized linear layer computes the same way, whatever its weight format."""
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from inferno.layers.quantization.thresholds import compute_dtype, gemm_from_rows


class QuantizedLinear(nn.Module):
    """A linear layer on a quantized weight. One forward for every format: the tiles once the warm-up has made them
    (`tile`: they run every batch size), else the format's matrix-vector kernel (`matmul`) below `gemm_from_rows`
    rows, else a GEMM (`gemm`: the weight dequantized to `compute_dtype` and a dense GEMM, unless the format has its
    own); then the output in the input's dtype, plus the bias. Inputs are zero-padded to `padded_in_features`, the
    columns a format may append to make whole groups (they add nothing).

    A subclass names its `weight_format` (its row threshold, `thresholds.GEMM_FROM_ROWS`) and supplies `matmul` and
    `dequantize`; a format with tiles also `tile_rows`, `make_tiles` and `tiles_matmul`. `native`: the kernels are
    built (else every batch runs the GEMM). `gemm_from_rows` and `compute_dtype` are read once, when the layer is
    made, for the CPU's instruction set then (thresholds.py)."""
    weight_format: ClassVar[str]
    tile_rows: ClassVar[int] = 0  # weight rows per tile; 0: the format has no tiles
    unread_when_tiled: ClassVar[tuple[str, ...]] = ("weight",)  # the buffers the tiles replace in the forward
    # made by the warm-up after loading, their shapes following from the weight's: the compile cache's key names the
    # layers that will have them instead (worker/compile_cache.py), so it can be made before they exist
    warm_up_buffers: ClassVar[tuple[str, ...]] = ("tiles",)

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, native: bool,
                 padded_in_features: int | None = None):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.padded_in_features = padded_in_features or in_features
        self.native = native
        self.gemm_from_rows = gemm_from_rows(self.weight_format)
        self.compute_dtype = compute_dtype()
        # the forward reads both every call: what stays None is a plain attribute (a buffer is a slower lookup)
        if bias is None:
            self.bias = None
        else:
            self.register_buffer("bias", bias)
        if self.tile_rows:
            self.register_buffer("tiles", None)  # set by `tile`: a buffer, which the huge-page move sees
        else:
            self.tiles = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, padded K] as it arrives -> [M, N] by the format's kernel."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, padded K] in `dtype`."""
        raise NotImplementedError

    def make_tiles(self) -> torch.Tensor:
        """The weight regrouped into the format's tiles by the native operator."""
        raise NotImplementedError

    def tiles_matmul(self, x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
        """x [M, padded K] as it arrives -> [M, N] by the native operator on the tiles."""
        raise NotImplementedError

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, padded K] -> [M, N] by a dense GEMM in `compute_dtype` on the dequantized weight."""
        return F.linear(x.to(self.compute_dtype), self.dequantize(self.compute_dtype))

    @property
    def can_tile(self) -> bool:
        return self.native and self.tile_rows > 0 and self.out_features % self.tile_rows == 0

    def tile(self) -> None:
        """Regroup the weight into tiles (every value kept). Their kernel is faster at every batch size, but the copy
        takes time (about 0.3 s per GB) and memory, so the model runner makes them, not the loader, when it is built
        (worker/tiles.py: a runner only, not a model loaded for its weights). The stored weight stays for
        `dequantize`, and the forward no longer reads it (`unread_buffers`)."""
        if self.can_tile and self.tiles is None:
            self.tiles = self.make_tiles()

    @property
    def unread_buffers(self) -> tuple[str, ...]:
        return () if self.tiles is None else self.unread_when_tiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a decode step calls this some 120 times: the reshapes and casts are skipped where they would change
        # nothing (each is an operator dispatched from Python, several microseconds apiece)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if self.padded_in_features != self.in_features:
            x2 = F.pad(x2, (0, self.padded_in_features - self.in_features))
        tiles = self.tiles  # once: the warm-up thread may set it meanwhile
        if tiles is not None:
            y = self.tiles_matmul(x2, tiles)
        elif self.native and x2.shape[0] < self.gemm_from_rows:
            y = self.matmul(x2)
        else:
            y = self.gemm(x2)
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], self.out_features)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


def float_rows(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous float32 rows, as the native kernels take them: x itself where it is (no operator called)."""
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
