"""A tensor-parallel rank's part of a layer's quantized checkpoint blocks: output rows for column-parallel layers and
the vocabulary (parallel_linear.py, vocab_parallel.py, as the float weights are cut), and for row-parallel ones
(o_proj, down_proj) too: they run on the gathered input (`GatheredRowParallel`), so every output is one process's.

The MoE experts' down_proj keeps its input columns (the block sums its experts' partial outputs before one
all-reduce). They are cut at block boundaries only, and only at a multiple of ACTIVATION_BLOCK: the kernels quantize
activations to int8 per block of 32 columns counted from the row's start, so a rank's blocks of x have one
process's scales and each block's integer dot product is the same; the float sums of the blocks and of the ranks'
partial outputs are added in another order. A cut inside a K-quant super-block (256 columns) takes the blocks as
Q8 groups (the same weights, exactly); a cut inside a block of 32 leaves the layer to load as float (`rank_blocks`
returns None)."""
import gguf
import torch
from torch import nn

from inferno.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from inferno.layers.quantization.groups import GroupCodes
from inferno.layers.quantization.native import GGUFRows
from inferno.layers.quantization.super_blocks import QK_K, SuperBlocks
from inferno.layers.vocab_parallel import VocabParallelEmbedding
from inferno.loader.gguf_blocks import Int4Blocks, as_q8_groups

ACTIVATION_BLOCK = 32  # columns per int8 activation scale in the kernels (X_BLOCK, kernels/quantized_rows.h)

Blocks = GGUFRows | GroupCodes | Int4Blocks | SuperBlocks


def rank_blocks(blocks: Blocks, layer: nn.Module, shard: int) -> Blocks | None:
    """This rank's part of checkpoint tensor `shard` of `layer` (a fused layer's q/k/v or gate/up), or None where
    its input columns cannot be cut without changing what the kernels compute."""
    if isinstance(layer, ColumnParallelLinear):
        return take_rows(blocks, layer.shards[shard], layer.full_sizes[shard])
    if isinstance(layer, VocabParallelEmbedding):
        return take_rows(blocks, layer.vocab_rows, layer.vocab_size)
    if isinstance(layer, RowParallelLinear) and layer.runs_gathered:
        return take_rows(blocks, layer.gathered_rows, layer.out_features)
    if isinstance(layer, RowParallelLinear):
        return take_columns(blocks, layer.columns, layer.full_in_features)
    return blocks


def held_shape(layer: nn.Module, param: nn.Parameter) -> tuple[int, ...]:
    """The shape of a rank's blocks of `layer`: its parameter's, but the vocabulary's rows unpadded and a gathered
    row-parallel layer's output rows of every input column."""
    if isinstance(layer, VocabParallelEmbedding):
        return len(layer.vocab_rows), param.shape[1]
    if isinstance(layer, RowParallelLinear) and layer.runs_gathered:
        return len(layer.gathered_rows), layer.full_in_features
    return tuple(param.shape)


def take_rows(blocks: Blocks, rows: range, total: int) -> Blocks:
    return blocks if len(rows) == total else blocks.map_rows(lambda t: t[rows.start:rows.stop])


def take_columns(blocks: Blocks, columns: range, total: int) -> Blocks | None:
    if len(columns) == total:
        return blocks
    if columns.start % ACTIVATION_BLOCK or columns.stop % ACTIVATION_BLOCK:
        return None
    if isinstance(blocks, SuperBlocks):
        if columns.start % QK_K == 0 and columns.stop % QK_K == 0:
            return type(blocks)(raw_columns(blocks.raw, columns, QK_K, blocks.BLOCK_BYTES))
        blocks = as_q8_groups(blocks, blocks.group_size)
    if isinstance(blocks, Int4Blocks):
        block, block_bytes = gguf.GGML_QUANT_SIZES[blocks.qtype]
        return Int4Blocks(raw_columns(blocks.raw, columns, block, block_bytes), blocks.qtype)
    if isinstance(blocks, GroupCodes):
        group = blocks.group_size
        if columns.start % group or columns.stop % group:
            return None
        cut = lambda t, unit: None if t is None else t[:, columns.start // unit:columns.stop // unit].contiguous()  # noqa: E731
        return type(blocks)(cut(blocks.codes, 1), cut(blocks.scales, group), cut(blocks.mins, group),
                            cut(blocks.zeros, group))
    raise ValueError(f"{type(blocks).__name__} blocks cannot be split across tensor-parallel ranks by columns")


def raw_columns(raw: torch.Tensor, columns: range, block: int, block_bytes: int) -> torch.Tensor:
    """Columns `columns` (whole blocks of `block`) of rows of blocks stored as bytes [rows, blocks * block_bytes]."""
    return raw[:, columns.start // block * block_bytes:columns.stop // block * block_bytes].contiguous()
