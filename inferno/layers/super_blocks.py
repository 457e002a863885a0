"""GGUF K-quant super-blocks run as stored (256 weights each, the bytes a decode step reads): what the Q4_K and Q6_K
layers (layers/q4_k.py, layers/q6_k.py) share. Decode-sized batches run the type's native matmul operator
(activations quantized to int8 per block of 32, integer dot products, as llama.cpp computes); larger ones
dequantize the weight once and run a dense GEMM in COMPUTE_DTYPE."""
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from inferno.layers.quantization import COMPUTE_DTYPE

QK_K = 256  # weights per super-block


@dataclass(slots=True)
class SuperBlocks:
    """A GGUF K-quant tensor's rows of super-blocks as stored, uint8 [N, K / 256 * BLOCK_BYTES]. Rows are
    independent: permuting or stacking rows of `raw` permutes or stacks the weight's rows."""
    raw: torch.Tensor

    BLOCK_BYTES: ClassVar[int]

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.raw.shape[1] // self.BLOCK_BYTES * QK_K

    def map_rows(self, fn) -> "SuperBlocks":
        return type(self)(fn(self.raw))

    @classmethod
    def cat(cls, parts: list["SuperBlocks"]) -> "SuperBlocks":
        """The parts' rows stacked: a view where they lie one after another in one storage (a GGUF file stores a
        layer's ffn_gate and ffn_up so), else a copy."""
        raws = [p.raw for p in parts]
        adjacent = all(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.is_contiguous()
                       and b.is_contiguous() and a.shape[1:] == b.shape[1:]
                       and b.storage_offset() == a.storage_offset() + a.numel() for a, b in zip(raws, raws[1:]))
        if adjacent:
            first = raws[0]
            return cls(first.as_strided((sum(r.shape[0] for r in raws), *first.shape[1:]), first.stride()))
        return cls(torch.cat(raws))

    def dequantize(self, dtype: torch.dtype = torch.float32, native: bool = True) -> torch.Tensor:
        """[N, K] in `dtype`, as `gguf.quants.dequantize` computes it in float32, rounded once."""
        raise NotImplementedError


@dataclass(slots=True)
class SuperBlockShards:
    """The parts of a fused projection (qkv_proj, gate_up_proj) stacked along the rows, each in its own type's
    super-blocks: a Q4_K_M file's Q4_K q/k and Q6_K v run as stored, none converted to a common form."""
    parts: list[SuperBlocks]

    @classmethod
    def of(cls, shards: list[SuperBlocks]) -> "SuperBlocks | SuperBlockShards":
        """Adjacent shards of one type stacked into one part (one kernel call for both); shards all of one type are
        one `SuperBlocks`."""
        parts = [shards[0]]
        for shard in shards[1:]:
            if type(shard) is type(parts[-1]):
                parts[-1] = type(shard).cat([parts[-1], shard])
            else:
                parts.append(shard)
        return parts[0] if len(parts) == 1 else cls(parts)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]


class SuperBlockLinear(nn.Module):
    """`SuperBlocks` as stored times activations quantized to int8 per block of 32: the native `matmul` operator up
    to `dequantize_from_rows` rows, dequantize-then-GEMM in COMPUTE_DTYPE beyond that or without the native
    kernels. A type with tiles (`tile_rows` > 0) can regroup its weight into them (`tile`, losslessly); from then on
    its `tiles_matmul` runs every batch size."""
    blocks_type: ClassVar[type[SuperBlocks]]
    dequantize_from_rows: ClassVar[int]
    tile_rows: ClassVar[int] = 0  # weight rows per tile; 0: the type has no tiles

    def __init__(self, weight: SuperBlocks, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.raw.contiguous())
        self.register_buffer("bias", bias)
        self.register_buffer("tiles", None)
        self.native = self.kernels() is not None

    @staticmethod
    def kernels():
        """The namespace of the native operators, or None when they cannot be built."""
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 contiguous -> [M, N] float32 by the native operator."""
        raise NotImplementedError

    def make_tiles(self) -> torch.Tensor:
        """The weight regrouped into the type's tiles by the native operator."""
        raise NotImplementedError

    def tiles_matmul(self, x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 contiguous -> [M, N] float32 by the native operator on the tiles."""
        raise NotImplementedError

    @property
    def can_tile(self) -> bool:
        return self.native and self.tile_rows > 0 and self.out_features % self.tile_rows == 0

    def tile(self) -> None:
        """Regroup the weight into tiles (every value kept). Their kernel is faster at every batch size, but the copy
        takes time (about 0.3 s per GB) and memory, so the model runner's background warm-up makes it, not the
        loader; steps switch to the tiles at once (the same integer sums, added in another order). The stored
        blocks stay for `dequantize`, and the forward no longer reads them (`unread_buffers`)."""
        if self.can_tile and self.tiles is None:
            self.tiles = self.make_tiles()

    @property
    def unread_buffers(self) -> tuple[str, ...]:
        return () if self.tiles is None else ("weight",)

    @property
    def blocks(self) -> SuperBlocks:
        return self.blocks_type(self.weight)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`, computed in float32 and rounded once."""
        return self.blocks.dequantize(dtype, self.native)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        tiles = self.tiles  # once: the warm-up thread may set it meanwhile
        if tiles is not None:
            y = self.tiles_matmul(x2.float().contiguous(), tiles)
        elif self.native and x2.shape[0] < self.dequantize_from_rows:
            y = self.matmul(x2.float().contiguous())
        else:
            y = F.linear(x2.to(COMPUTE_DTYPE), self.dequantize(COMPUTE_DTYPE))
        y = y.view(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


class ShardedLinear(nn.Module):
    """A fused projection whose parts keep their own super-blocks (`SuperBlockShards`): one layer per part, their
    outputs side by side."""

    def __init__(self, parts: list[SuperBlockLinear], bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = sum(p.out_features for p in parts), parts[0].in_features
        self.parts = nn.ModuleList(parts)
        self.register_buffer("bias", bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias
