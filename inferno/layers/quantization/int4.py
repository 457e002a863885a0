"""int4: group-wise unsigned 4-bit codes with a float16 scale and min per group (w = q * scale + min, the GGUF
Q4_0 / Q4_1 block form) or a float16 scale and an integer zero point per group (w = (q - zero) * scale, the AWQ /
GPTQ form, `ZeroPointInt4`), through the native `inferno::int4_q8_matmul`, whose activations are quantized to int8
per block of 32 for integer dot products (as llama.cpp computes Q4 x Q8)."""
import torch
from torch import nn

from inferno.kernels import TILE_ROWS, quantized_gemv
from inferno.layers.quantization.groups import GroupQuantized, PackedInt4, ZeroPointInt4, pad_columns, quantize_int4
from inferno.layers.quantization.linear import QuantizedLinear, float_rows

INT4_CHUNK_BLOCKS = 16  # blocks of 32 columns whose codes the int4 kernel sums in one go


class Int4Linear(QuantizedLinear):
    """Group-wise 4-bit weights in the layout of the native `inferno::int4_q8_matmul` (kernels/quantized_gemv.cpp):
    per output row, the codes in chunks of 16 blocks of 32 columns interleaved 4 codes at a time (see `pack_int4`),
    then a float16 scale per group, then a float16 min (or, `zero_points`, integer zero point) per group; one
    contiguous stream per row. Decode-sized
    batches run the kernel; from `gemm_from_rows` rows, or without the native kernels, a dense GEMM in
    `compute_dtype` on the dequantized weight. Like `SuperBlockLinear`, the weight can be regrouped into tiles of 16
    rows (`tile`, every value kept; `inferno::int4_tiles_matmul`), which then run every batch size: 2-3x the
    kernel's speed from 8 rows on, and above the dense GEMMs at prefill sizes (SmolLM2-135M's shapes, 2 threads,
    32-512 rows: AVX-512 425-567 GMAC/s against 169-283 packed and 93-407 bfloat16; capped at AVX2, 156-226 against
    83-123 packed and 37-98 float32; `benchmarks/kernels.py --int4-tiles`, RESULTS.md `int4-tiles`)."""
    weight_format = "int4"
    tile_rows = TILE_ROWS

    def __init__(self, weight: GroupQuantized | ZeroPointInt4 | PackedInt4, bias: torch.Tensor | None,
                 in_features: int | None = None):
        """`weight` may have columns appended (up to a multiple of the group size) beyond `in_features`; inputs are
        zero-padded alike, so those columns add nothing. A `PackedInt4` is taken as it is."""
        out_features, k = weight.shape
        group_size = weight.group_size
        if isinstance(weight, (PackedInt4, ZeroPointInt4)):
            if k % group_size:
                raise ValueError(f"packed int4 rows of {k} columns are not whole groups of {group_size}")
            packed = weight.packed.contiguous() if isinstance(weight, PackedInt4) else pack_int4(weight)
            padded = k
        else:
            weight = pad_columns(weight, group_size)
            padded, packed = weight.codes.shape[1], pack_int4(weight)
        super().__init__(out_features, in_features or k, bias, native=quantized_gemv() is not None,
                         padded_in_features=padded)
        self.group_size = group_size
        self.zero_points = isinstance(weight, ZeroPointInt4) or (isinstance(weight, PackedInt4) and weight.zero_points)
        self.register_buffer("weight", packed)

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int) -> "Int4Linear":
        w = linear.weight.detach()
        return cls(quantize_int4(w, group_size), linear.bias, w.shape[1])

    def make_tiles(self) -> torch.Tensor:
        return torch.ops.inferno.int4_tile(self.weight, self.padded_in_features, self.group_size)

    def tiles_matmul(self, x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
        return torch.ops.inferno.int4_tiles_matmul(float_rows(x), tiles, self.zero_points)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.inferno.int4_q8_matmul(float_rows(x), self.weight, self.group_size, self.zero_points)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, padded K] in `dtype` (computed in float32)."""
        n, k = self.out_features, self.padded_in_features
        if self.native and dtype in (torch.float32, torch.bfloat16):
            return torch.ops.inferno.int4_dequantize(self.weight, k, self.group_size, dtype, self.zero_points)
        groups = k // self.group_size
        codes = unpack_int4(self.weight[:, :k // 2]).view(n, groups, self.group_size)
        halves = self.weight[:, k // 2:].contiguous().view(torch.float16).float()  # [N, 2 * groups]
        scales, mins = halves[:, :groups].unsqueeze(-1), halves[:, groups:].unsqueeze(-1)
        if self.zero_points:
            mins = -mins * scales
        return torch.addcmul(mins, codes.float(), scales).view(n, k).to(dtype)


def pack_int4(weight: GroupQuantized | ZeroPointInt4) -> torch.Tensor:
    """4-bit codes [N, K] (K a multiple of 32), scales and mins (or zero points) [N, groups] -> the int4 kernel's
    rows, uint8 [N, K / 2 + 4 * groups]. The codes go in chunks of INT4_CHUNK_BLOCKS blocks of 32 (the last may be
    shorter); a chunk of b blocks is 4 runs of 4 * b bytes, run v holding 4 bytes per block: codes 4v..4v+3 of the
    block in the low nibbles, codes 16 + 4v..16 + 4v + 3 in the high ones."""
    n, k = weight.codes.shape
    chunks = []
    for chunk in weight.codes.view(n, k // 32, 32).split(INT4_CHUNK_BLOCKS, dim=1):
        halves = chunk.view(n, chunk.shape[1], 2, 4, 4)  # (block, high nibble, run, byte)
        nibbles = halves[:, :, 0] | (halves[:, :, 1] << 4)
        chunks.append(nibbles.transpose(1, 2).reshape(n, -1))
    second = weight.zeros if isinstance(weight, ZeroPointInt4) else weight.mins
    scales = torch.cat([weight.scales.to(torch.float16), second.to(torch.float16)], dim=1).view(torch.uint8)
    return torch.cat(chunks + [scales], dim=1).contiguous()


def unpack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """The codes part of pack_int4's rows, uint8 [N, K / 2] -> codes [N, K] in column order."""
    n = nibbles.shape[0]
    blocks = []
    for chunk in nibbles.split(INT4_CHUNK_BLOCKS * 16, dim=1):
        runs = chunk.reshape(n, 4, -1, 4).transpose(1, 2)  # (block, run, byte)
        blocks.append(torch.stack([runs & 0x0F, runs >> 4], dim=2).reshape(n, -1))
    return torch.cat(blocks, dim=1)
