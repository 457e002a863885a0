"""What the PyTorch and native CPU backends know of a step: decode groups and prefill chunks of the flat batch.

The cache of one layer is head-major, `[num_kv_heads, num_blocks, block_size, head_dim]`, so gathering a
request's blocks yields K/V already laid out as `[kv_heads, tokens, head_dim]` for batched matmuls.
"""
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first token of the chunk in the flat batch
    end: int
    num_computed_tokens: int  # tokens of this request already in the cache before the chunk
    block_table: torch.Tensor  # [blocks] long: the request's blocks up to the chunk's last token
    # PyTorch path only: rows of the flattened cache holding this request's blocks (see block_rows) and
    # [chunk, context] bool, None when there is no earlier context (plain causal)
    block_rows: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    window_mask: torch.Tensor | None = None  # the same limited to the sliding window (models that have one)


@dataclass(slots=True)
class PackedPrefills:
    """Every prefill chunk of a step, one after another after the decode rows: the native kernel takes them all in
    one call (a step of many short prompts is then one parallel region per layer, not one per prompt)."""
    start: int  # first row of the first chunk in the flat batch
    end: int
    block_tables: torch.Tensor  # [chunks, width] long, each row padded with block 0
    query_start: torch.Tensor  # [chunks + 1] long: where each chunk's rows start, from 0 (row `start`)
    seq_lens: torch.Tensor  # [chunks] long: tokens cached before each chunk plus its own


@dataclass(slots=True)
class DecodeGroup:
    start: int  # decode tokens [start, end) of the flat batch
    end: int
    block_tables: torch.Tensor  # [end - start, width] long, padded with block 0
    seq_lens: torch.Tensor  # [end - start] long
    # PyTorch path only: [kv_heads * (end - start) * width] rows of the flattened cache (see block_rows) and
    # [1, end - start, 1, width * block_size] bool: key position < seq_len
    block_rows: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    window_mask: torch.Tensor | None = None  # mask limited to the sliding window (models that have one)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V goes
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk] | list[PackedPrefills]  # one per chunk (PyTorch), one for all (native kernel)
    # native kernel: runs of decode rows that are nodes of a draft tree, attended again on the PyTorch path with
    # masks that hide the other branches (the kernel reads every key up to a row's sequence length)
    tree_groups: list[DecodeGroup] = field(default_factory=list)


def block_rows(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Row indices into a cache viewed as [kv_heads * num_blocks, block_size * head_dim], head-major."""
    heads = torch.arange(num_kv_heads, device=block_ids.device).unsqueeze(1)
    return (heads * num_blocks + block_ids.view(1, -1)).view(-1)


def gather(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[kv_heads, num_blocks, block_size, head_dim] -> [kv_heads, tokens, head_dim] (one 2-D row gather)."""
    kv_heads, num_blocks, block_size, head_dim = cache.shape
    return cache.view(kv_heads * num_blocks, block_size * head_dim).index_select(0, rows).view(kv_heads, -1, head_dim)
