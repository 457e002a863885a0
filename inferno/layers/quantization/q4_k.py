"""GGUF Q4_K weights run as stored: super-blocks of 256 weights in 144 bytes (4.5 bits per weight), the bytes a
decode step reads, with no repacking at load (the int4 layout took 5 bits per weight and rounded d * sc and
dmin * m to float16). Until the warm-up regroups them into tiles, decode-sized batches run the native
`inferno::q4_k_matmul` (kernels/q4_k_gemv.cpp) and larger ones dequantize the weight once and run a dense GEMM
(`SuperBlockLinear`). The tiles (`inferno::q4_k_tile`: 16 weight rows in the lanes of a vector, every value kept,
4.625 bits per weight) run every batch size through `inferno::q4_k_tiles_matmul`: on Qwen2.5-1.5B's gate/up
(AVX-512, 2 threads, `python benchmarks/kernels.py --tiles`) 629 / 646 GMAC/s at 32 / 128 rows against the stored
blocks' 185 / 175 and the dense bfloat16 GEMM's 157 / 330, 1.0-1.7x the stored blocks' at one row (memory-bound).
"""
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from inferno.kernels import TILE_ROWS, q4_k_gemv
from inferno.layers.quantization.linear import float_rows
from inferno.layers.quantization.super_blocks import SuperBlockLinear, SuperBlocks


@dataclass(slots=True)
class Q4KBlocks(SuperBlocks):
    """A GGUF Q4_K tensor's rows of super-blocks as stored, uint8 [N, K / 256 * 144]. A super-block: float16 d and
    dmin, 12 bytes of 6-bit scales sc_j and mins m_j of its 8 sub-blocks of 32, 128 bytes of 4-bit codes q;
    w = (d * sc_j) * q - dmin * m_j."""
    BLOCK_BYTES = 144
    group_size = 32  # of the Q8 groups that hold the same weights (a sub-block: its scale and min)

    def dequantize(self, dtype: torch.dtype = torch.float32, native: bool = True) -> torch.Tensor:
        """[N, K] in `dtype` as `gguf.quants.dequantize` computes it (float32), rounded once; by the native operator
        when it is built (and `native`), else by `gguf.quants.dequantize` itself."""
        if native and q4_k_gemv() is not None and dtype in (torch.float32, torch.bfloat16):
            return torch.ops.inferno.q4_k_dequantize(self.raw.contiguous(), dtype)
        w = gguf.quants.dequantize(self.raw.numpy(), gguf.GGMLQuantizationType.Q4_K)
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(dtype)


class Q4KLinear(SuperBlockLinear):
    """Q4_K super-blocks as stored (`Q4KBlocks`) through the native `inferno::q4_k_matmul` below
    `gemm_from_rows` rows (see `SuperBlockLinear`)."""
    blocks_type = Q4KBlocks
    weight_format = "q4_k"
    tile_rows = TILE_ROWS

    @staticmethod
    def kernels():
        return q4_k_gemv()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.inferno.q4_k_matmul(float_rows(x), self.weight)

    def make_tiles(self) -> torch.Tensor:
        return torch.ops.inferno.q4_k_tile(self.weight)

    def tiles_matmul(self, x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
        return torch.ops.inferno.q4_k_tiles_matmul(float_rows(x), tiles)
