"""Megatron-style tensor-parallel linear layers. With one rank they are plain `nn.Linear`s.

Column-parallel layers hold a slice of the output features and need no communication: their sharded output feeds
a row-parallel layer, which holds the matching slice of the input features and sums the partial products of all
ranks with one all-reduce. Each layer knows which rows (or columns) of the checkpoint tensors it holds and copies
only those at load time (`weight_loader`), so a rank never keeps the whole weight. Quantized checkpoint blocks are
cut likewise (`loader/block_shards.py`), but a quantized row-parallel layer is cut by output rows and runs on the
gathered input (`GatheredRowParallel`), so that every output is one process's.
"""
import torch
from torch import nn

from inferno.distributed.parallel_state import ParallelRank
from inferno.distributed.partition import even_split, split_heads
from inferno.kernels import TILE_ROWS
from inferno.layers.packed_linear import linear


def check_shape(name: str, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(loaded.shape)}, expected {expected}")


class ColumnParallelLinear(nn.Linear):
    """Output features: this rank's rows of one or more checkpoint tensors, stacked (fused QKV or gate/up)."""

    def __init__(self, in_features: int, full_sizes: list[int], shards: list[range], bias: bool):
        super().__init__(in_features, sum(len(rows) for rows in shards), bias=bias)
        self.full_sizes = full_sizes
        self.shards = shards
        self.offsets = [sum(len(rows) for rows in shards[:i]) for i in range(len(shards))]

    def weight_loader(self, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        check_shape(name, loaded, (self.full_sizes[shard_id], *param.shape[1:]))
        rows, offset = self.shards[shard_id], self.offsets[shard_id]
        param.data[offset:offset + len(rows)].copy_(loaded[rows.start:rows.stop])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q, K and V projections of this rank's attention heads (see `split_heads`)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 parallel: ParallelRank):
        heads = split_heads(num_heads, num_kv_heads, parallel.tp_size, parallel.tp_rank)
        q_rows = range(heads.q_heads.start * head_dim, heads.q_heads.stop * head_dim)
        kv_rows = range(heads.kv_heads.start * head_dim, heads.kv_heads.stop * head_dim)
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         [q_rows, kv_rows, kv_rows], bias)
        self.num_heads = len(heads.q_heads)
        self.num_kv_heads = len(heads.kv_heads)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Fused gate and up projections: the same slice of the intermediate features from each."""

    def __init__(self, hidden_size: int, intermediate_size: int, parallel: ParallelRank):
        rows = even_split(intermediate_size, parallel.tp_size, parallel.tp_rank)
        super().__init__(hidden_size, [intermediate_size, intermediate_size], [rows, rows], bias=False)


class RowParallelLinear(nn.Linear):
    """Input features `columns` of the checkpoint weight; the ranks' partial outputs are summed by one all-reduce
    (unless `reduce` is False: the caller sums several layers' outputs first)."""

    def __init__(self, full_in_features: int, columns: range, out_features: int, parallel: ParallelRank,
                 reduce: bool = True):
        super().__init__(len(columns), out_features, bias=False)
        self.full_in_features = full_in_features
        self.columns = columns
        self.parallel = parallel
        self.reduce = reduce

    @property
    def runs_gathered(self) -> bool:
        """Quantized, this layer runs as `GatheredRowParallel` (the MoE experts' down_proj, summed by their block
        before one all-reduce, keeps its input columns)."""
        return self.parallel.tp_size > 1 and self.reduce

    @property
    def gathered_rows(self) -> range:
        """This rank's output rows in `GatheredRowParallel`: whole tiles of TILE_ROWS rows, so that each rank's part
        is regrouped into tiles (and computed) as one process's is."""
        return even_split(self.out_features, self.parallel.tp_size, self.parallel.tp_rank, TILE_ROWS)

    def weight_loader(self, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        check_shape(name, loaded, (param.shape[0], self.full_in_features))
        param.data.copy_(loaded[:, self.columns.start:self.columns.stop])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias)
        return out if self.parallel.tp_size == 1 or not self.reduce else self.parallel.all_reduce(out)


class GatheredRowParallel(nn.Module):
    """A row-parallel layer run as a column-parallel one, for quantized layers whose kernels re-quantize their
    inputs to int8 (per block of 32 columns): every rank gathers the whole input rows, computes its `rows` of the
    output with `layer` (those rows of the weight), and the outputs are gathered back. Each output is then the one
    a single process computes, bit for bit: summing the ranks' partial products would round differently, and the
    next layer's int8 rounding turns a last-bit difference into up to a logit. A gather is an all-reduce of
    zero-padded parts (adding zeros is exact): two per layer instead of one."""

    def __init__(self, layer: nn.Module, row_parallel: RowParallelLinear):
        super().__init__()
        self.layer = layer
        self.parallel = row_parallel.parallel
        self.columns, self.full_in_features = row_parallel.columns, row_parallel.full_in_features
        self.rows, self.out_features = row_parallel.gathered_rows, row_parallel.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(self.gather(x, self.columns, self.full_in_features))
        return self.gather(y, self.rows, self.out_features)

    def gather(self, part: torch.Tensor, held: range, size: int) -> torch.Tensor:
        whole = part.new_zeros(*part.shape[:-1], size)
        whole[..., held.start:held.stop] = part
        return self.parallel.all_reduce(whole)
