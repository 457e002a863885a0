"""GGUF quantized blocks repacked, without dequantizing, into the forms inferno's kernels run: every operation is
vectorised over a whole tensor (raw bytes [rows, bytes per row], a view of the memory-mapped file).

- `int4_groups`: Q4_0 and Q4_1 as 4-bit codes with a scale and a min per group of 32 (`GroupQuantized`, the
  `Int4Linear` input), exact (`Int4Linear` stores scales and mins as float16, the files' own d and m).
- `int4_rows` / `pack_int4_shards`: Q4_0 and Q4_1 straight into `Int4Linear`'s packed rows (a fused layer's shards
  into one tensor), the same bytes as `pack_int4(int4_groups(...))`.
- `q8_groups`: every supported type as signed 8-bit codes with a float32 scale (and min) per group of 32, or 16 for
  Q6_K (`Q8Groups`, the `Q8Linear` input): exact, `codes * scales + mins` is what `gguf.quants.dequantize` computes.
- `q6_k_blocks`: Q6_K rows as stored (`Q6KBlocks`, the `Q6KLinear` input), 6.5625 bits per weight where Q8 groups
  of 16 take 10; Q4_K rows run as stored too (`Q4KBlocks`, layers/quantization/q4_k.py).

`pack_int4_shards` and `q8_groups` run the native operators of kernels/gguf_repack.cpp (row-parallel, no intermediate
tensors) when they build; the PyTorch paths (`int4_groups`, `decode`) are the fallback and the tests' reference.
"""
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from inferno.kernels import Q8_WITH_MINS, gguf_repack
from inferno.layers.quantization.q4_k import Q4KBlocks
from inferno.layers.quantization.q6_k import Q6KBlocks
from inferno.layers.quantization.groups import GroupQuantized, PackedInt4, Q8Groups
from inferno.layers.quantization.int4 import pack_int4

T = gguf.GGMLQuantizationType
INT4_TYPES = (T.Q4_0, T.Q4_1)  # Q4_K runs as stored (Q4KBlocks)
Q8_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q8_0)
QK_K = 256  # values per K-quant super-block


Raw = np.ndarray | torch.Tensor  # a tensor's bytes, uint8 [rows, bytes per row]


def rows_of(raw: Raw) -> torch.Tensor:
    return raw if isinstance(raw, torch.Tensor) else torch.from_numpy(raw)


def blocks_of(raw: Raw, qtype: T) -> torch.Tensor:
    """Raw bytes [rows, bytes per row] -> uint8 [rows, blocks per row, bytes per block] (no copy)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return rows_of(raw).view(raw.shape[0], -1, type_size)


def half(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian float16 bytes -> float32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> [..., 2n]: the n low nibbles, then the n high nibbles (the order of a 32-value run)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Little-endian bit masks uint8 [..., count // 8] -> 0/1 uint8 [..., count], bit j of the mask first."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :count]


def k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit sub-block scales and mins -> two float32 [..., 8]."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def decode(raw: Raw, qtype: T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Codes [rows, K] (uint8, or int8 when signed), scales and mins (None: symmetric) [rows, K / G], and G, with
    w = codes * scales + mins exactly as `gguf.quants.dequantize` computes it."""
    b = blocks_of(raw, qtype)
    rows, n = b.shape[:2]
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        header = 4 if qtype in (T.Q4_1, T.Q5_1) else 2
        five_bit = qtype in (T.Q5_0, T.Q5_1)
        q = nibbles(b[..., header + 4 * five_bit:])
        if five_bit:
            q |= high_bits(b[..., header:header + 4], 32) << 4
        scales = half(b[..., 0:2])
        if header == 4:
            return q.view(rows, -1), scales, half(b[..., 2:4]), 32
        offset = 16 if five_bit else 8
        return (q.to(torch.int8) - offset).view(rows, -1), scales, None, 32
    if qtype == T.Q8_0:
        return b[..., 2:].contiguous().view(torch.int8).view(rows, -1), half(b[..., 0:2]), None, 32
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin = half(b[..., 0:2]).unsqueeze(-1), half(b[..., 2:4]).unsqueeze(-1)
        sc, mn = k_scales(b[..., 4:16])
        if qtype == T.Q4_K:
            q = nibbles(b[..., 16:].reshape(rows, n, 4, 32))  # [rows, n, 4, 64]: sub-blocks 2i and 2i + 1
        else:
            q = nibbles(b[..., 48:].reshape(rows, n, 4, 32))
            q |= high_bits(b[..., 16:48], 256).view(rows, n, 32, 8).transpose(-1, -2).reshape(rows, n, 4, 64) << 4
        return q.view(rows, -1), (d * sc).view(rows, -1), (-(dmin * mn)).view(rows, -1), 32
    if qtype == T.Q6_K:
        groups = Q6KBlocks(rows_of(raw)).q8_groups()
        return groups.codes, groups.scales, None, 16
    raise ValueError(f"GGUF tensor type {qtype.name} has no native form (supported: "
                     f"{', '.join(t.name for t in Q8_TYPES)})")


def int4_groups(raw: Raw, qtype: T) -> GroupQuantized:
    """Q4_0 / Q4_1 -> unsigned 4-bit codes in groups of 32 (Q4_0: min -8 * d)."""
    if qtype not in INT4_TYPES:
        raise ValueError(f"GGUF tensor type {qtype.name} is not a 4-bit type")
    b = blocks_of(raw, qtype)
    rows = b.shape[0]
    if qtype == T.Q4_0:
        scales = half(b[..., 0:2])
        return GroupQuantized(nibbles(b[..., 2:]).view(rows, -1), scales, -8 * scales)
    codes, scales, mins, _ = decode(raw, qtype)
    return GroupQuantized(codes, scales, mins)


@dataclass(slots=True)
class Int4Blocks:
    """A GGUF 4-bit tensor's rows (a view of the memory map, or those rows permuted), packed for the int4 kernel
    only once its layer's shards are known (`pack_int4_shards`), or read as exact Q8 groups when the layer mixes
    it with other types."""
    raw: torch.Tensor  # uint8 [rows, bytes per row]
    qtype: T
    group_size: int = 32

    @property
    def shape(self) -> tuple[int, int]:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.raw.shape[0], self.raw.shape[1] // size * block

    def map_rows(self, fn) -> "Int4Blocks":
        return Int4Blocks(fn(self.raw), self.qtype)

    def pack_into(self, out: torch.Tensor) -> None:
        """The int4 kernel's rows (`pack_int4(int4_groups(raw, qtype))`, bit for bit) into `out`."""
        ops = gguf_repack()
        if ops is not None:
            ops.gguf_to_int4(self.raw, int(self.qtype), out)
        else:
            out.copy_(pack_int4(int4_groups(self.raw, self.qtype)))

    def q8_groups(self) -> Q8Groups:
        return q8_groups(self.raw, self.qtype)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, exact."""
        return self.q8_groups().dequantize()


def int4_rows(raw: Raw, qtype: T) -> Int4Blocks:
    if qtype not in INT4_TYPES:
        raise ValueError(f"GGUF tensor type {qtype.name} is not a 4-bit type")
    return Int4Blocks(rows_of(raw), qtype)


def pack_int4_shards(shards: list[Int4Blocks]) -> PackedInt4:
    """The shards of a layer (stacked along the rows) packed straight into one tensor of int4 rows."""
    k = shards[0].shape[1]
    if any(s.shape[1] != k for s in shards):
        raise ValueError("4-bit shards of a fused layer must have the same number of columns")
    packed = torch.empty(sum(s.shape[0] for s in shards), k // 2 + 4 * (k // 32), dtype=torch.uint8)
    row = 0
    for s in shards:
        s.pack_into(packed[row:row + s.shape[0]])
        row += s.shape[0]
    return PackedInt4(packed, k, 32)


def q6_k_blocks(raw: Raw) -> Q6KBlocks:
    """Q6_K rows as stored: a view of the file's memory map (copy-on-write, so the file is never written)."""
    return Q6KBlocks(rows_of(raw))


def q8_groups(raw: Raw, qtype: T) -> Q8Groups:
    """Any supported type -> Q8Groups: the native repack when it is built, else `q8_groups_reference`."""
    ops = gguf_repack()
    if ops is None or qtype not in Q8_TYPES:
        return q8_groups_reference(raw, qtype)
    codes, scales, mins = ops.gguf_to_q8(rows_of(raw), int(qtype))
    return Q8Groups(codes, scales, mins if qtype in Q8_WITH_MINS else None)


def q8_groups_reference(raw: Raw, qtype: T) -> Q8Groups:
    """q8_groups with PyTorch ops."""
    codes, scales, mins, _ = decode(raw, qtype)
    return Q8Groups(codes.view(torch.int8) if codes.dtype == torch.uint8 else codes, scales, mins)


def as_q8_groups(weight: GroupQuantized | Int4Blocks | Q4KBlocks | Q6KBlocks | Q8Groups, group_size: int) -> Q8Groups:
    """A layer's weight in the common form of a fused layer whose shards differ: Q8Groups with groups of
    `group_size` (16 or 32; a group of 32 becomes two of 16 with the same scale and min). Exact."""
    if isinstance(weight, Int4Blocks):
        weight = weight.q8_groups()
    if isinstance(weight, (Q4KBlocks, Q6KBlocks)):
        weight = q8_groups(weight.raw, T.Q4_K if isinstance(weight, Q4KBlocks) else T.Q6_K)
    if isinstance(weight, GroupQuantized):  # 4-bit codes fit int8 as they are
        weight = Q8Groups(weight.codes.view(torch.int8), weight.scales, weight.mins)
    repeat = weight.group_size // group_size
    if repeat == 1:
        return weight
    spread = lambda t: None if t is None else t.repeat_interleave(repeat, dim=1)  # noqa: E731
    return Q8Groups(weight.codes, spread(weight.scales), spread(weight.mins))
