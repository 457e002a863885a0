"""GGUF K-quant super-blocks run as stored (256 weights each, the bytes a decode step reads): what the Q4_K and Q6_K
layers (q4_k.py, q6_k.py) share. Decode-sized batches run the type's native matmul operator (activations
quantized to int8 per block of 32, integer dot products, as llama.cpp computes); larger ones dequantize the weight
once and run a dense GEMM (`QuantizedLinear`)."""
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from inferno.layers.quantization.linear import QuantizedLinear

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


class SuperBlockLinear(QuantizedLinear):
    """`SuperBlocks` as stored times activations quantized to int8 per block of 32: the native `matmul` operator below
    `gemm_from_rows` rows, dequantize-then-GEMM in `compute_dtype` from there or without the native kernels. A type
    with tiles (`tile_rows` > 0) can regroup its weight into them (`tile`, losslessly); from then on its
    `tiles_matmul` runs every batch size."""
    blocks_type: ClassVar[type[SuperBlocks]]

    def __init__(self, weight: SuperBlocks, bias: torch.Tensor | None = None):
        super().__init__(*weight.shape, bias, native=self.kernels() is not None)
        self.register_buffer("weight", weight.raw.contiguous())

    @staticmethod
    def kernels():
        """The namespace of the native operators, or None when they cannot be built."""
        raise NotImplementedError

    @property
    def blocks(self) -> SuperBlocks:
        return self.blocks_type(self.weight)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`, computed in float32 and rounded once."""
        return self.blocks.dequantize(dtype, self.native)


class ShardedLinear(nn.Module):
    """A fused projection whose parts keep their own super-blocks (`SuperBlockShards`): one layer per part, their
    outputs side by side."""

    def __init__(self, parts: list[SuperBlockLinear], bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = sum(p.out_features for p in parts), parts[0].in_features
        self.parts, self.num_parts = nn.ModuleList(parts), len(parts)
        self.register_buffer("bias", bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # parts by index, not by iterating the list: dynamo guards the order of the keys of a module dict it iterates,
        # a guard a precompiled decode step cannot load (torch 2.13: its source names the model, absent at load)
        y = torch.cat([self.parts[i](x) for i in range(self.num_parts)], dim=-1)
        return y if self.bias is None else y + self.bias
