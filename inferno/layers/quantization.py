"""Weight-only quantized linear layers for CPU inference.

- int8, group-wise (the default): unsigned 8-bit codes with a float32 scale and min per group of 32/64/128 input
  columns (w = q * scale + min, asymmetric), float32 activations, the native `inferno::int8_group_matmul` kernel
  (kernels/quantized_gemv.cpp) for the few rows of a decode step. GGUF Q4_0/Q4_1 blocks of 32 load as they are
  (their 4-bit codes are 8-bit codes too), so the default model keeps its own weights.
- int8, per output channel (group size PER_CHANNEL): absmax scales, `torch._weight_int8pack_mm` (fast only with
  bfloat16 activations: float32 ones are 10-50x slower on torch 2.13 CPU, so the layer computes in bfloat16).
- int4: group-wise unsigned 4-bit with a float16 scale and min per group (w = q * scale + min, the GGUF Q4_0/Q4_1
  block form) or a float16 scale and an integer zero point per group (w = (q - zero) * scale, the AWQ / GPTQ form,
  `ZeroPointInt4`), the native `inferno::int4_q8_matmul` kernel, whose activations are quantized to int8 per block
  of 32 for integer dot products (as llama.cpp computes Q4 x Q8).
- Q8 (`Q8Linear`): signed int8 codes with a float32 scale (and optionally a min) per group of 16 or 32 columns
  (`Q8Groups`, which the GGUF Q8_0, Q5_0, Q5_1, Q5_K and Q6_K blocks hold exactly), activations quantized to int8
  per block of 32, the native `inferno::int8_q8_matmul`. Also the LM head of the int4 and per-channel int8 models
  (symmetric groups of 32, Q8_0).

Every layer returns the caller's dtype; from a row count per kind (prefill, large batches) the weight is
dequantized once and a dense GEMM runs in COMPUTE_DTYPE instead of the matrix-vector kernels.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inferno.config import PER_CHANNEL
from inferno.cpu_features import cpu_flags, has_native_bfloat16
from inferno.kernels import TILE_ROWS, quantized_gemv

# The dense GEMMs of prefill and large batches (on dequantized weights): bfloat16 where the CPU has native
# instructions for it (AVX512-BF16, AMX), float32 elsewhere (AVX2 has none: PyTorch's emulated bfloat16 GEMM is
# slower than float32 there).
COMPUTE_DTYPE = torch.bfloat16 if has_native_bfloat16() else torch.float32
INT4_CHUNK_BLOCKS = 16  # blocks of 32 columns whose codes the int4 kernel sums in one go
LM_HEAD_GROUP_SIZE = 32  # the int8 LM head: symmetric groups of 32, the GGUF Q8_0 block (exact for it)
# From this many rows (prefill, large batches) the layers dequantize their weight and run the dense GEMM instead of
# the matrix-vector kernels. The kernels' paths, and the dense dtype, differ per CPU (quantized_gemv.cpp):
AVX512_KERNELS = {"avx512_vnni", "avx512bw"} <= cpu_flags()
# - per-channel int8 (`_weight_int8pack_mm`), 3072x576 weight, 512 rows, one core: 41-45 ms against 4 ms
#   dequantize-then-GEMM; the crossover is near 32 rows.
INT8_DEQUANTIZE_FROM_ROWS = 32
# - AVX-512: int4 (96) measured against PyTorch's int4 kernel before the VNNI kernel replaced it; group-wise int8,
#   the 4 projections of one SmolLM2 layer, one core: 16 rows 2.41 ms against 2.48, 32 rows 5.1 against 3.1; the
#   Q8_0 LM head (49152x576), one core: 64 rows 37 ms against 89, 256 rows 150 against 103 (bfloat16 GEMM).
# - AVX2 (float32 GEMM), ms of CPU per decode step of SmolLM2-135M's projections, one thread (benchmarks/
#   kernels.py --projections --cpu-time): int4 64 rows 259 against 651, 256 rows 963 against 1303; Q8_0 256 rows
#   1015 against 1102; group-wise int8 64 rows 462 against 478, 128 rows 1048 against 644. Per row the int4 and Q8
#   kernels cost about what the float32 GEMM does, so the dequantization never pays back below a few hundred rows.
INT4_DEQUANTIZE_FROM_ROWS = 96 if AVX512_KERNELS else 512
INT8_GROUP_DEQUANTIZE_FROM_ROWS = 16 if AVX512_KERNELS else 64
Q8_DEQUANTIZE_FROM_ROWS = 160 if AVX512_KERNELS else 512


@dataclass(slots=True)
class GroupQuantized:
    """Unsigned codes with a scale and a min per group of `K / scales.shape[1]` input columns."""
    codes: torch.Tensor  # [N, K] uint8: in [0, 15] for 4 bits, [0, 255] for 8 bits
    scales: torch.Tensor  # [N, K / group] float32
    mins: torch.Tensor  # [N, K / group] float32

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        groups = self.codes.view(n, -1, self.group_size).float()
        return (groups * self.scales.unsqueeze(-1) + self.mins.unsqueeze(-1)).view(n, k)

    def map_rows(self, fn) -> "GroupQuantized":
        """Apply a row permutation (e.g. the rotary row order of Q/K) to codes, scales and mins alike."""
        return GroupQuantized(fn(self.codes), fn(self.scales), fn(self.mins))

    @staticmethod
    def cat(parts: list["GroupQuantized"]) -> "GroupQuantized":
        return GroupQuantized(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                              torch.cat([p.mins for p in parts]))


@dataclass(slots=True)
class Q8Groups:
    """Signed 8-bit codes with a float32 scale, and optionally a min, per group of `K / scales.shape[1]` (16 or 32)
    input columns: w = codes * scales (+ mins). The GGUF types map onto it exactly (q: the block's stored
    integers): Q8_0 c=q s=d G=32; Q5_0 c=q-16 s=d G=32; Q5_1 c=q s=d min=m G=32; Q5_K c=q s=d*sc min=-dmin*m
    G=32; Q6_K c=q-32 s=d*sc G=16; Q4_K c=q s=d*sc min=-dmin*m G=32."""
    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K / group] float32
    mins: torch.Tensor | None  # [N, K / group] float32, or None (symmetric)

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: codes * scales + mins, in float32 and in that order."""
        n, k = self.codes.shape
        w = self.codes.view(n, -1, self.group_size).float() * self.scales.unsqueeze(-1)
        return (w if self.mins is None else w + self.mins.unsqueeze(-1)).view(n, k)

    def map_rows(self, fn) -> "Q8Groups":
        """Apply a row permutation (e.g. the rotary row order of Q/K) to codes, scales and mins alike."""
        return Q8Groups(fn(self.codes), fn(self.scales), None if self.mins is None else fn(self.mins))

    @staticmethod
    def cat(parts: list["Q8Groups"]) -> "Q8Groups":
        """Stacked along the output rows; a part without mins gets zeros when another has them."""
        mins = None
        if any(p.mins is not None for p in parts):
            mins = torch.cat([torch.zeros_like(p.scales) if p.mins is None else p.mins for p in parts])
        return Q8Groups(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins)


@dataclass(slots=True)
class ZeroPointInt4:
    """4-bit codes with a float16 scale and an integer zero point per group of `K / scales.shape[1]` input columns:
    w = (codes - zeros) * scales, the form of AWQ and GPTQ checkpoints (exact in float32)."""
    codes: torch.Tensor  # [N, K] uint8 in [0, 15]
    scales: torch.Tensor  # [N, K / group] float16
    zeros: torch.Tensor  # [N, K / group] uint8 (GPTQ's v1 format: up to 16)

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        centered = self.codes.view(n, -1, self.group_size).float() - self.zeros.float().unsqueeze(-1)
        return (centered * self.scales.float().unsqueeze(-1)).view(n, k)

    def map_rows(self, fn) -> "ZeroPointInt4":
        return ZeroPointInt4(fn(self.codes), fn(self.scales), fn(self.zeros))

    @staticmethod
    def cat(parts: list["ZeroPointInt4"]) -> "ZeroPointInt4":
        return ZeroPointInt4(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                             torch.cat([p.zeros for p in parts]))


@dataclass(slots=True)
class PackedInt4:
    """4-bit groups already in the int4 kernel's row layout (`pack_int4`'s rows; the GGUF loader's native repack
    writes them straight from Q4_0 / Q4_1 / Q4_K blocks). Rows are independent: permuting or stacking rows of
    `packed` permutes or stacks the weight's rows."""
    packed: torch.Tensor  # [N, K / 2 + 4 * K / group_size] uint8
    k: int
    group_size: int = 32
    zero_points: bool = False  # the second float16 per group is a zero point (ZeroPointInt4), not a min

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.k

    def map_rows(self, fn) -> "PackedInt4":
        return PackedInt4(fn(self.packed), self.k, self.group_size, self.zero_points)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> int8 codes [N, K] and per-row scales [N] (w ≈ codes * scale)."""
    scales = w.float().abs().amax(dim=1).clamp(min=1e-12) / 127
    codes = torch.round(w.float() / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return codes, scales


def pad_to_groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, K rounded up to a multiple of group_size], repeating the last column (which leaves the range
    of the last group as it was)."""
    missing = -w.shape[1] % group_size
    return torch.cat([w, w[:, -1:].expand(-1, missing)], dim=1) if missing else w


def quantize_groups(w: torch.Tensor, group_size: int, bits: int) -> GroupQuantized:
    """[N, K] float -> asymmetric `bits`-bit groups along K: each group's min and (max - min) / (2^bits - 1) as
    scale; K is padded up to a multiple of group_size (pad_to_groups)."""
    levels = (1 << bits) - 1
    w = pad_to_groups(w.float(), group_size)
    n, k = w.shape
    groups = w.view(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((hi - lo) / levels).clamp(min=1e-12)
    codes = torch.round((groups - lo.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp(0, levels).to(torch.uint8)
    return GroupQuantized(codes.view(n, k), scales, lo)


def quantize_groups_symmetric(w: torch.Tensor, group_size: int) -> GroupQuantized:
    """quantize_q8_symmetric's groups as unsigned codes c + 128 with min = -128 * scale."""
    q = quantize_q8_symmetric(w, group_size)
    return GroupQuantized((q.codes.short() + 128).to(torch.uint8), q.scales, -128 * q.scales)


def quantize_q8_symmetric(w: torch.Tensor, group_size: int) -> Q8Groups:
    """[N, K] float -> absmax int8 groups (w = c * scale, c in [-127, 127]), K padded up to a multiple of
    group_size (pad_to_groups). GGUF Q8_0 blocks (absmax / 127 per 32) come back exactly with group_size 32."""
    w = pad_to_groups(w.float(), group_size)
    n, k = w.shape
    groups = w.view(n, k // group_size, group_size)
    scales = (groups.abs().amax(dim=-1) / 127).clamp(min=1e-12)
    codes = torch.round(groups / scales.unsqueeze(-1)).clamp(-127, 127)
    return Q8Groups(codes.to(torch.int8).view(n, k), scales, None)


def quantize_int4(w: torch.Tensor, group_size: int) -> GroupQuantized:
    """[N, K] float -> asymmetric 4-bit groups along K."""
    return quantize_groups(w, group_size, bits=4)


class Int8Linear(nn.Module):
    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("weight", codes.contiguous())
        self.register_buffer("scales", scales.bfloat16())  # _weight_int8pack_mm is fast with bfloat16 only
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "Int8Linear":
        return cls(*quantize_int8(linear.weight.detach()), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] >= INT8_DEQUANTIZE_FROM_ROWS:
            w = self.weight.to(COMPUTE_DTYPE) * self.scales.to(COMPUTE_DTYPE).unsqueeze(1)
            y = F.linear(x2.to(COMPUTE_DTYPE), w)
        else:
            y = torch._weight_int8pack_mm(x2.bfloat16(), self.weight, self.scales)
        y = y.view(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int8GroupLinear(nn.Module):
    """Group-wise int8 weights, float32 activations: the native kernel for decode-sized batches, dequantize-then-
    float32-GEMM from INT8_GROUP_DEQUANTIZE_FROM_ROWS rows (or without a C++ compiler)."""

    def __init__(self, weight: GroupQuantized, bias: torch.Tensor | None, in_features: int | None = None):
        """`weight` may have columns appended (up to a multiple of the group size) beyond `in_features`: they are
        dropped; the last group is then partial."""
        super().__init__()
        self.out_features = weight.codes.shape[0]
        self.in_features = in_features or weight.codes.shape[1]
        self.group_size = weight.group_size
        self.register_buffer("weight", weight.codes[:, :self.in_features].contiguous())
        self.register_buffer("scales", weight.scales.float().contiguous())
        self.register_buffer("mins", weight.mins.float().contiguous())
        self.register_buffer("bias", bias)
        self.native = quantized_gemv() is not None  # the kernel is built (and its torch.ops registered)

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int) -> "Int8GroupLinear":
        w = linear.weight.detach()
        return cls(quantize_groups(w, group_size, bits=8), linear.bias, w.shape[1])

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32."""
        if self.native:
            return torch.ops.inferno.int8_group_dequantize(self.weight, self.scales, self.mins, self.group_size)
        n, k = self.weight.shape
        groups = self.scales.shape[1]
        codes = F.pad(self.weight, (0, groups * self.group_size - k)).view(n, groups, self.group_size)
        w = torch.addcmul(self.mins.unsqueeze(-1), codes, self.scales.unsqueeze(-1))
        return w.view(n, groups * self.group_size)[:, :k]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float().contiguous()
        if self.native and x2.shape[0] < INT8_GROUP_DEQUANTIZE_FROM_ROWS:
            y = torch.ops.inferno.int8_group_matmul(x2, self.weight, self.scales, self.mins, self.group_size)
        else:
            y = F.linear(x2, self.dequantize())
        y = y.view(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Q8Linear(nn.Module):
    """Signed int8 codes with a float32 scale (and optionally a min) per group of 16 or 32 input columns
    (`Q8Groups`: the GGUF Q8_0, Q5_0, Q5_1, Q5_K and Q6_K blocks hold exactly), times activations quantized to
    int8 per block of 32, as llama.cpp computes: the integer dot products of the native `inferno::int8_q8_matmul`
    up to Q8_DEQUANTIZE_FROM_ROWS rows, dequantize-then-GEMM in COMPUTE_DTYPE beyond that or without the native
    kernels. Also the LM head of the int4 and per-channel int8 models (symmetric groups of 32). Symmetric groups of
    32 (Q8_0, Q5_0, the LM heads) can be regrouped into tiles of 16 rows (`tile`, every value kept;
    `inferno::q8_tiles_matmul`), which then run every batch size with the same integer sums."""

    def __init__(self, weight: Q8Groups, in_features: int, bias: torch.Tensor | None = None):
        """`weight` may have columns appended beyond `in_features` (up to a multiple of 32): inputs are zero-padded
        alike, so those columns add nothing."""
        super().__init__()
        if weight.group_size not in (16, 32) or weight.codes.shape[1] % 32:
            raise ValueError(f"Q8Linear takes groups of 16 or 32 and a multiple of 32 columns, got groups of "
                             f"{weight.group_size} and {weight.codes.shape[1]} columns")
        self.out_features, self.in_features = weight.codes.shape[0], in_features
        self.padded_in_features, self.group_size = weight.codes.shape[1], weight.group_size
        self.register_buffer("weight", weight.codes.contiguous())
        self.register_buffer("scales", weight.scales.float().contiguous())
        self.register_buffer("mins", None if weight.mins is None else weight.mins.float().contiguous())
        self.register_buffer("bias", bias)
        self.register_buffer("tiles", None)
        self.native = quantized_gemv() is not None

    @property
    def can_tile(self) -> bool:
        return self.native and self.group_size == 32 and self.mins is None and self.out_features % TILE_ROWS == 0

    def tile(self) -> None:
        """Regroup the weight into tiles (the model runner's warm-up does it, before it compiles the decode step: see
        SuperBlockLinear.tile). The codes and scales stay for `dequantize`; the forward no longer reads them."""
        if self.can_tile and self.tiles is None:
            self.tiles = torch.ops.inferno.q8_tile(self.weight, self.scales)

    @property
    def unread_buffers(self) -> tuple[str, ...]:
        return () if self.tiles is None else ("weight", "scales")

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Q8Linear":
        """Symmetric groups of LM_HEAD_GROUP_SIZE (absmax / 127): the GGUF Q8_0 block, exact for it."""
        return cls(quantize_q8_symmetric(weight.detach(), LM_HEAD_GROUP_SIZE), weight.shape[1])

    @property
    def q8_groups(self) -> Q8Groups:
        return Q8Groups(self.weight, self.scales, self.mins)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, padded K] in `dtype`, computed in float32 (codes * scales + mins) and rounded once."""
        if self.native and dtype in (torch.float32, torch.bfloat16):
            return torch.ops.inferno.int8_q8_dequantize(self.weight, self.scales, self.mins, self.group_size, dtype)
        return self.q8_groups.dequantize().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.padded_in_features != self.in_features:
            x2 = F.pad(x2, (0, self.padded_in_features - self.in_features))
        tiles = self.tiles  # once: the warm-up thread may set it meanwhile
        if tiles is not None:
            y = torch.ops.inferno.q8_tiles_matmul(x2.float().contiguous(), tiles)
        elif self.native and x2.shape[0] < Q8_DEQUANTIZE_FROM_ROWS:
            y = torch.ops.inferno.int8_q8_matmul(x2.float().contiguous(), self.weight, self.scales, self.mins,
                                                 self.group_size)
        else:
            y = F.linear(x2.to(COMPUTE_DTYPE), self.dequantize(COMPUTE_DTYPE))
        y = y.view(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """Group-wise 4-bit weights in the layout of the native `inferno::int4_q8_matmul` (kernels/quantized_gemv.cpp):
    per output row, the codes in chunks of 16 blocks of 32 columns interleaved 4 codes at a time (see `pack_int4`),
    then a float16 scale per group, then a float16 min (or, `zero_points`, integer zero point) per group; one
    contiguous stream per row. Decode-sized
    batches run the kernel; from INT4_DEQUANTIZE_FROM_ROWS rows, or without the native kernels, a dense GEMM in
    COMPUTE_DTYPE on the dequantized weight. Like `SuperBlockLinear`, the weight can be regrouped into tiles of 16
    rows (`tile`, every value kept; `inferno::int4_tiles_matmul`), which then run every batch size: 2-3x the
    kernel's speed from 8 rows on, and above the dense GEMMs at prefill sizes (SmolLM2-135M's shapes, 2 threads,
    32-512 rows: AVX-512 425-567 GMAC/s against 169-283 packed and 93-407 bfloat16; capped at AVX2, 156-226 against
    83-123 packed and 37-98 float32; `benchmarks/kernels.py --int4-tiles`, RESULTS.md `int4-tiles`)."""

    def __init__(self, weight: GroupQuantized | ZeroPointInt4 | PackedInt4, bias: torch.Tensor | None,
                 in_features: int | None = None):
        """`weight` may have columns appended (up to a multiple of the group size) beyond `in_features`; inputs are
        zero-padded alike, so those columns add nothing. A `PackedInt4` is taken as it is."""
        super().__init__()
        self.out_features, k = weight.shape
        self.in_features = in_features or k
        self.group_size = weight.group_size
        self.zero_points = isinstance(weight, ZeroPointInt4) or (isinstance(weight, PackedInt4) and weight.zero_points)
        if isinstance(weight, (PackedInt4, ZeroPointInt4)):
            if k % self.group_size:
                raise ValueError(f"packed int4 rows of {k} columns are not whole groups of {self.group_size}")
            packed = weight.packed.contiguous() if isinstance(weight, PackedInt4) else pack_int4(weight)
            self.padded_in_features = k
        else:
            weight = pad_columns(weight, self.group_size)
            self.padded_in_features, packed = weight.codes.shape[1], pack_int4(weight)
        self.register_buffer("weight", packed)
        self.register_buffer("bias", bias)
        self.register_buffer("tiles", None)
        self.native = quantized_gemv() is not None

    @property
    def can_tile(self) -> bool:
        return self.native and self.out_features % TILE_ROWS == 0

    def tile(self) -> None:
        """Regroup the weight into tiles (the model runner's warm-up does it, before it compiles the decode step: see
        SuperBlockLinear.tile). The packed rows stay for `dequantize`; the forward no longer reads them."""
        if self.can_tile and self.tiles is None:
            self.tiles = torch.ops.inferno.int4_tile(self.weight, self.padded_in_features, self.group_size)

    @property
    def unread_buffers(self) -> tuple[str, ...]:
        return () if self.tiles is None else ("weight",)

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int) -> "Int4Linear":
        w = linear.weight.detach()
        return cls(quantize_int4(w, group_size), linear.bias, w.shape[1])

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.padded_in_features != self.in_features:
            x2 = F.pad(x2, (0, self.padded_in_features - self.in_features))
        tiles = self.tiles  # once: the warm-up thread may set it meanwhile
        if tiles is not None:
            y = torch.ops.inferno.int4_tiles_matmul(x2.float().contiguous(), tiles, self.zero_points)
        elif self.native and x2.shape[0] < INT4_DEQUANTIZE_FROM_ROWS:
            y = torch.ops.inferno.int4_q8_matmul(x2.float().contiguous(), self.weight, self.group_size,
                                                 self.zero_points)
        else:
            y = F.linear(x2.to(COMPUTE_DTYPE), self.dequantize(COMPUTE_DTYPE))
        y = y.view(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


def pad_columns(weight: GroupQuantized, multiple: int) -> GroupQuantized:
    """Whole groups of zero weights (codes, scales and mins 0) appended up to a multiple of `multiple` columns."""
    n, k = weight.codes.shape
    missing = -k % multiple
    if not missing:
        return weight
    return GroupQuantized(F.pad(weight.codes, (0, missing)), F.pad(weight.scales, (0, missing // weight.group_size)),
                          F.pad(weight.mins, (0, missing // weight.group_size)))


def pack_int4(weight: GroupQuantized | ZeroPointInt4) -> torch.Tensor:
    """4-bit codes [N, K] (K a multiple of 32), scales and mins (or zero points) [N, groups] -> the int4 kernel's
    rows, uint8 [N, K / 2 + 4 * groups]. The codes go in chunks of INT4_CHUNK_BLOCKS blocks of 32 (the last may be shorter);
    a chunk of b blocks is 4 runs of 4 * b bytes, run v holding 4 bytes per block: codes 4v..4v+3 of the block in
    the low nibbles, codes 16 + 4v..16 + 4v + 3 in the high ones."""
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


def quantize_linears(model: nn.Module, method: str, group_size: int,
                     prequantized: dict[str, GroupQuantized] | None = None) -> None:
    """Swap every projection of the decoder layers for its quantized form, and the LM head for symmetric int8
    groups of LM_HEAD_GROUP_SIZE: with float32 activations in the (exact) group-wise int8 model, with activations
    quantized to int8 (Q8Linear) in the int4 and per-channel int8 models.

    `method` "int8" with `group_size` PER_CHANNEL is the per-channel form. `prequantized` maps a layer's name to
    4-bit codes read straight from the checkpoint (GGUF Q4_0/Q4_1 with blocks of `group_size`); those are packed
    as they are (int4) or taken as 8-bit codes (group-wise int8), the rest are quantized from their float weights.
    The quantized layers hold whole weights and do no all-reduce: one tensor-parallel rank only (each pipeline
    stage quantizes the layers it holds).
    """
    prequantized = prequantized or {}
    grouped_int8 = method == "int8" and group_size != PER_CHANNEL
    for name, module in list(model.named_modules()):
        if name == "lm_head" and grouped_int8:  # a (single-rank) ParallelLMHead: logits = hidden @ weight.t()
            quantized = Int8GroupLinear(quantize_groups_symmetric(module.weight.detach(), LM_HEAD_GROUP_SIZE), None,
                                        module.weight.shape[1])
        elif name == "lm_head":
            quantized = Q8Linear.from_float(module.weight)
        elif not isinstance(module, nn.Linear):
            continue
        elif grouped_int8 and name in prequantized:
            quantized = Int8GroupLinear(prequantized[name], module.bias)
        elif grouped_int8:
            quantized = Int8GroupLinear.from_float(module, group_size)
        elif method == "int8":
            quantized = Int8Linear.from_float(module)
        elif name in prequantized:
            quantized = Int4Linear(prequantized[name], module.bias)
        else:
            quantized = Int4Linear.from_float(module, group_size)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, quantized)
