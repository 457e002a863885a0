"""Paged attention in plain PyTorch: write new K/V into the block pool, attend through block tables.

One flat batch holds decode tokens first (one query each, batched into a single SDPA call over K/V gathered
through their block tables) and then prefill chunks (one SDPA call each; causal over the chunk plus the
context already in the cache).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first token of the chunk in the flat batch
    end: int
    num_computed_tokens: int  # tokens of this request already in the cache before the chunk
    block_table: torch.Tensor  # [num_blocks] long
    mask: torch.Tensor | None  # [chunk, context] bool; None when there is no earlier context (plain causal)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V goes
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] long
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool: key position < seq_len
    prefills: list[PrefillChunk]


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, kv_heads, head_dim], table [..., n] -> [..., kv_heads, n * block_size, head_dim]."""
    blocks = cache[block_table]  # [..., n, block_size, kv_heads, head_dim]
    *lead, n, block_size, kv_heads, head_dim = blocks.shape
    return blocks.view(*lead, n * block_size, kv_heads, head_dim).transpose(-3, -2)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H * D]."""
        self.k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        self.v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        # decode
        nd = meta.num_decode_tokens
        if nd:
            keys = gather_blocks(self.k_cache, meta.decode_block_tables)
            values = gather_blocks(self.v_cache, meta.decode_block_tables)
            out[:nd] = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True,
            ).squeeze(2)
        # prefill chunks
        for chunk in meta.prefills:
            query = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            if chunk.mask is None:
                keys = k[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
                values = v[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
                attn = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=self.scale,
                                                      enable_gqa=True)
            else:
                keys = gather_blocks(self.k_cache, chunk.block_table).unsqueeze(0)
                values = gather_blocks(self.v_cache, chunk.block_table).unsqueeze(0)
                attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=chunk.mask, scale=self.scale,
                                                      enable_gqa=True)
            out[chunk.start:chunk.end] = attn.squeeze(0).transpose(0, 1)
        return out.view(q.shape[0], -1)
