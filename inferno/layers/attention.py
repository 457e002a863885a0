"""Paged attention in plain PyTorch: write new K/V into the block pool, attend through block tables.

The cache of one layer is head-major, `[num_kv_heads, num_blocks, block_size, head_dim]`, so gathering a
request's blocks yields K/V already laid out as `[kv_heads, tokens, head_dim]` for batched matmuls.
One flat batch holds decode tokens first (one query each) and then prefill chunks (one SDPA call each; causal
over the chunk plus the context already in the cache). Decodes run in the native kernel, which reads K/V through
the block tables in place; without it, they are sorted by length and attended in groups, each one batched
matmul over K/V gathered through the group's block tables, padded to its longest member.

Sliding-window layers see only the keys within `sliding_window` positions of each query (`window_mask`s; the
kernel starts each sequence at its window); soft-capped scores (Gemma 2) take the explicit PyTorch path.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inferno.kernels import paged_attention
from inferno.layers.kv_quantization import gather_kv, write_kv


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first token of the chunk in the flat batch
    end: int
    num_computed_tokens: int  # tokens of this request already in the cache before the chunk
    block_rows: torch.Tensor  # rows of the flattened cache holding this request's blocks (see block_rows)
    mask: torch.Tensor | None  # [chunk, context] bool; None when there is no earlier context (plain causal)
    window_mask: torch.Tensor | None = None  # the same limited to the sliding window (models that have one)


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
    prefills: list[PrefillChunk]

    @property
    def num_decode_tokens(self) -> int:
        return self.decode_groups[-1].end if self.decode_groups else 0


def block_rows(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Row indices into a cache viewed as [kv_heads * num_blocks, block_size * head_dim], head-major."""
    return (torch.arange(num_kv_heads).unsqueeze(1) * num_blocks + block_ids.view(1, -1)).view(-1)


def gather(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[kv_heads, num_blocks, block_size, head_dim] -> [kv_heads, tokens, head_dim] (one 2-D row gather)."""
    kv_heads, num_blocks, block_size, head_dim = cache.shape
    return cache.view(kv_heads * num_blocks, block_size * head_dim).index_select(0, rows).view(kv_heads, -1, head_dim)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None) -> torch.Tensor:
    """query [1, H, Q, D], keys/values [1, KVH, K, D], mask [Q, K] bool (None: causal) -> [1, H, Q, D]."""
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=True)
    # soft-capped scores, cap * tanh(scores / cap): no fused kernel takes them
    group = query.shape[1] // keys.shape[1]
    scores = torch.matmul(query, keys.repeat_interleave(group, dim=1).transpose(-1, -2)).mul_(scale)
    scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), values.repeat_interleave(group, dim=1))


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # quantized KV cache (int8 / fp8 codes in k_cache / v_cache): per-token-per-head scales; None otherwise
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.kernels = paged_attention()

    def copy_blocks(self, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Copy-on-write: whole blocks of this layer's cache, `sources[i]` to `destinations[i]` (a quantized cache's
        codes, as bytes: CPU indexing has no fp8 kernel, and their scales)."""
        if self.k_scale is None:
            tensors = (self.k_cache, self.v_cache)
        else:
            tensors = (self.k_cache.view(torch.uint8), self.v_cache.view(torch.uint8), self.k_scale, self.v_scale)
        for cache in tensors:
            cache[:, destinations] = cache[:, sources]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H * D]."""
        if self.k_scale is None:
            self.k_cache.view(self.num_kv_heads, -1, self.head_dim).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
            self.v_cache.view(self.num_kv_heads, -1, self.head_dim).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        else:
            write_kv(self.k_cache, self.k_scale, meta.slot_mapping, k)
            write_kv(self.v_cache, self.v_scale, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            out[group.start:group.end] = self._decode(q[group.start:group.end], group)
        for chunk in meta.prefills:
            query = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            mask = chunk.window_mask if self.sliding_window else chunk.mask
            if chunk.mask is None:
                keys = k[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
                values = v[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            else:
                keys, values = self._gather_kv(chunk.block_rows, q.dtype)
                keys, values = keys.unsqueeze(0), values.unsqueeze(0)
            attn = attend(query, keys, values, mask, self.scale, self.softcap)
            out[chunk.start:chunk.end] = attn.squeeze(0).transpose(0, 1)
        return out.view(q.shape[0], -1)

    def _gather_kv(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k_scale is None:
            return gather(self.k_cache, rows), gather(self.v_cache, rows)
        return gather_kv(self.k_cache, self.k_scale, rows, dtype), gather_kv(self.v_cache, self.v_scale, rows, dtype)

    def _decode(self, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        if group.block_rows is None:
            return self.kernels.paged_decode_attention(q.contiguous(), self.k_cache, self.v_cache, group.block_tables,
                                                       group.seq_lens, self.scale, self.sliding_window or 0)
        return self._decode_gathered(q, group)

    def _decode_gathered(self, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """One query per request: scores [kv_heads, B, q_per_kv, L] from one batched matmul over gathered blocks."""
        batch = q.shape[0]
        q_per_kv = self.num_heads // self.num_kv_heads
        keys, values = self._gather_kv(group.block_rows, q.dtype)
        keys = keys.view(self.num_kv_heads, batch, -1, self.head_dim)
        values = values.view(self.num_kv_heads, batch, -1, self.head_dim)
        query = q.view(batch, self.num_kv_heads, q_per_kv, self.head_dim).transpose(0, 1)
        scores = torch.matmul(query, keys.transpose(-1, -2)).mul_(self.scale)
        if self.softcap is not None:
            scores = torch.tanh(scores.div_(self.softcap)).mul_(self.softcap)
        scores.masked_fill_(~(group.window_mask if self.sliding_window else group.mask), float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1), values)  # [kv_heads, B, group, D]
        return out.transpose(0, 1).reshape(batch, self.num_heads, self.head_dim)
