"""GGUF Q6_K weights run as stored: super-blocks of 256 weights in 210 bytes (6.5625 bits per weight), the bytes a
decode step reads, against 10 bits per weight for the same weights as Q8 groups of 16 (int8 codes and a float32
scale per 16). Decode-sized batches run the native `inferno::q6_k_matmul` (kernels/q6_k_gemv.cpp: activations
quantized to int8 per block of 32, integer dot products, as llama.cpp computes); larger ones dequantize the weight
once and run a dense GEMM. Once the warm-up has regrouped the weight into tiles
(`inferno::q6_k_tile`, every value kept, 6.5625 bits per weight), `inferno::q6_k_tiles_matmul` runs every batch size
(3-5x faster than the stored blocks' kernel from 4 rows on, see q4_k.py)."""
from dataclasses import dataclass

import torch
from torch import nn

from inferno.kernels import TILE_ROWS, q6_k_gemv
from inferno.layers.quantization.groups import Q8Groups
from inferno.layers.quantization.linear import float_rows
from inferno.layers.quantization.super_blocks import SuperBlockLinear, SuperBlocks

BLOCK_BYTES = 210  # per super-block


@dataclass(slots=True)
class Q6KBlocks(SuperBlocks):
    """A GGUF Q6_K tensor's rows of super-blocks as stored, uint8 [N, K / 256 * 210]. A super-block: ql[128] (the
    codes' 4 low bits), qh[64] (their 2 high bits), 16 int8 scales sc (one per group of 16), a float16 d;
    w = d * sc * (q - 32)."""
    BLOCK_BYTES = BLOCK_BYTES
    group_size = 16  # of the Q8 groups that hold the same weights (`q8_groups`)

    def q8_groups(self) -> Q8Groups:
        """The same weights as signed codes q - 32 with the float32 scale d * sc per group of 16 (exact)."""
        rows = self.raw.shape[0]
        b = self.raw.reshape(rows, -1, BLOCK_BYTES)
        n = b.shape[1]
        ql, qh = b[..., 0:128].reshape(rows, n, 2, 64), b[..., 128:192].reshape(rows, n, 2, 1, 32)
        low = torch.cat([ql & 0x0F, ql >> 4], dim=-1).view(rows, n, 2, 4, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
        q = (low | (((qh >> shifts) & 3) << 4)).to(torch.int8) - 32
        sc = b[..., 192:208].contiguous().view(torch.int8).float()
        d = b[..., 208:210].contiguous().view(torch.float16).float()
        return Q8Groups(q.view(rows, -1), (d * sc).view(rows, -1), None)

    def dequantize(self, dtype: torch.dtype = torch.float32, native: bool = True) -> torch.Tensor:
        """[N, K] in `dtype`: (d * sc) * (q - 32) in float32, as `gguf.quants.dequantize` computes it, rounded once;
        by the native operator when it is built (and `native`)."""
        if native and q6_k_gemv() is not None and dtype in (torch.float32, torch.bfloat16):
            return torch.ops.inferno.q6_k_dequantize(self.raw.contiguous(), dtype)
        return self.q8_groups().dequantize().to(dtype)


class Q6KLinear(SuperBlockLinear):
    """Q6_K super-blocks as stored (`Q6KBlocks`) through the native `inferno::q6_k_matmul` below
    `gemm_from_rows` rows (see `SuperBlockLinear`)."""
    blocks_type = Q6KBlocks
    weight_format = "q6_k"
    tile_rows = TILE_ROWS

    @staticmethod
    def kernels():
        return q6_k_gemv()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.inferno.q6_k_matmul(float_rows(x), self.weight)

    def make_tiles(self) -> torch.Tensor:
        return torch.ops.inferno.q6_k_tile(self.weight)

    def tiles_matmul(self, x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
        return torch.ops.inferno.q6_k_tiles_matmul(float_rows(x), tiles)


class Q6KEmbedding(nn.Module):
    """The token embedding as Q6_K super-blocks: a lookup dequantizes only the rows it reads."""

    def __init__(self, weight: Q6KBlocks, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self.register_buffer("blocks", weight.raw.contiguous())

    def as_lm_head(self) -> Q6KLinear:
        """A tied LM head reading the same super-blocks."""
        return Q6KLinear(Q6KBlocks(self.blocks))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = Q6KBlocks(self.blocks[input_ids.flatten()]).dequantize(self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)
