"""Quantized weights as integer codes with parameters per group of input columns, and the quantizers that make
them from float weights.

`GroupCodes` holds them all: w = (codes - zeros) * scales + mins per group (no zero point, no min: 0). Its forms
name which layer computes with them:
- `GroupQuantized`: unsigned 4- or 8-bit codes with a float32 scale and min (the GGUF Q4_0 / Q4_1 blocks; the
  group-wise int8 and int4 layers);
- `Q8Groups`: signed int8 codes with a float32 scale and optionally a min per group of 16 or 32 (the GGUF Q8_0,
  Q5_0, Q5_1, Q5_K and Q6_K blocks; `Q8Linear`);
- `ZeroPointInt4`: 4-bit codes with a float16 scale and an integer zero point (AWQ / GPTQ; `Int4Linear`).
"""
from dataclasses import dataclass
from typing import Self

import torch
import torch.nn.functional as F

LM_HEAD_GROUP_SIZE = 32  # the int8 LM head: symmetric groups of 32, the GGUF Q8_0 block (exact for it)


@dataclass(slots=True)
class GroupCodes:
    """Integer codes [N, K] with a scale, and optionally a min or an integer zero point, per group of
    `K / scales.shape[1]` input columns: w = (codes - zeros) * scales + mins, in float32 and in that order. Rows are
    independent: permuting or stacking the rows of every tensor permutes or stacks the weight's rows."""
    codes: torch.Tensor  # [N, K]
    scales: torch.Tensor  # [N, K / group]
    mins: torch.Tensor | None = None  # [N, K / group] float32
    zeros: torch.Tensor | None = None  # [N, K / group] integers

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32."""
        n, k = self.codes.shape
        w = self.codes.view(n, -1, self.group_size).float()
        if self.zeros is not None:
            w = w - self.zeros.float().unsqueeze(-1)
        w = w * self.scales.float().unsqueeze(-1)
        return (w if self.mins is None else w + self.mins.unsqueeze(-1)).view(n, k)

    def map_rows(self, fn) -> Self:
        """Apply a row permutation (e.g. the rotary row order of Q/K) to every tensor alike."""
        return type(self)(*(None if t is None else fn(t) for t in (self.codes, self.scales, self.mins, self.zeros)))

    @classmethod
    def cat(cls, parts: list[Self]) -> Self:
        """Stacked along the output rows; a part without mins gets zeros when another has them."""
        mins = None
        if any(p.mins is not None for p in parts):
            mins = torch.cat([torch.zeros_like(p.scales) if p.mins is None else p.mins for p in parts])
        zeros = torch.cat([p.zeros for p in parts]) if parts[0].zeros is not None else None
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins, zeros)


@dataclass(slots=True)
class GroupQuantized(GroupCodes):
    """Unsigned codes (uint8 in [0, 15] for 4 bits, [0, 255] for 8) with a float32 scale and min per group:
    w = codes * scales + mins."""


@dataclass(slots=True)
class Q8Groups(GroupCodes):
    """Signed int8 codes with a float32 scale, and optionally a min, per group of 16 or 32 input columns:
    w = codes * scales (+ mins). The GGUF types map onto it exactly (q: the block's stored integers): Q8_0 c=q s=d
    G=32; Q5_0 c=q-16 s=d G=32; Q5_1 c=q s=d min=m G=32; Q5_K c=q s=d*sc min=-dmin*m G=32; Q6_K c=q-32 s=d*sc G=16;
    Q4_K c=q s=d*sc min=-dmin*m G=32."""


@dataclass(slots=True)
class ZeroPointInt4(GroupCodes):
    """4-bit codes (uint8 in [0, 15]) with a float16 scale and an integer zero point (uint8, GPTQ's v1 format: up
    to 16) per group: w = (codes - zeros) * scales, the form of AWQ and GPTQ checkpoints (exact in float32)."""

    def __post_init__(self):
        if self.zeros is None or self.mins is not None:
            raise ValueError("ZeroPointInt4 takes codes, scales and zeros= (no mins)")


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


def pad_columns(weight: GroupQuantized, multiple: int) -> GroupQuantized:
    """Whole groups of zero weights (codes, scales and mins 0) appended up to a multiple of `multiple` columns."""
    n, k = weight.codes.shape
    missing = -k % multiple
    if not missing:
        return weight
    return GroupQuantized(F.pad(weight.codes, (0, missing)), F.pad(weight.scales, (0, missing // weight.group_size)),
                          F.pad(weight.mins, (0, missing // weight.group_size)))
