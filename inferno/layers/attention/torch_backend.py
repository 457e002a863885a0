"""Paged attention in plain PyTorch: any head size, quantized KV caches, soft-capped scores.

One flat batch holds decode rows first (one query each) and then prefill chunks (one SDPA call each; causal over
the chunk plus the context already in the cache). Decode rows are sorted by length and attended in groups, each
one batched matmul over K/V gathered through the group's block tables, padded to its longest member.

Sliding-window layers see only the keys within `sliding_window` positions of each query (`window_mask`s).
"""
import torch
import torch.nn.functional as F

from inferno.core.kv_blocks import cdiv
from inferno.layers.attention.backend import AttentionBackend
from inferno.layers.attention.layer import Attention
from inferno.layers.attention.metadata import AttentionMetadata, DecodeGroup, PrefillChunk, block_rows, gather
from inferno.layers.kv_quantization import gather_kv, write_kv

DECODE_GROUP_SIZE = 32  # decodes sorted by length are attended in groups padded to their longest


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
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), values.repeat_interleave(group, dim=1))


class TorchAttentionBackend(AttentionBackend):
    """Decodes gathered in groups, prefills through SDPA."""
    name = "torch"
    decode_group_size = DECODE_GROUP_SIZE
    prefill_reads_new_kv = True  # a chunk without cached context runs SDPA on its own k, v

    def __init__(self, block_size: int, num_kv_heads: int, num_cache_blocks: int, sliding_window: int | None,
                 device: torch.device = torch.device("cpu")):
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.num_cache_blocks = num_cache_blocks
        self.sliding_window = sliding_window  # the model's window (its sliding layers use it)
        self.device = device

    # --- metadata --------------------------------------------------------------------------------------------
    def build_metadata(self, slot_mapping: list[int], decodes: list[tuple[int, list[int]]],
                       prefills: list[tuple[int, int, list[int]]],
                       tree_hidden_keys: dict[int, list[int]] | None = None) -> AttentionMetadata:
        size = max(len(decodes), 1) if self.decode_group_size is None else self.decode_group_size
        groups = [self.decode_group(i, decodes[i:i + size]) for i in range(0, len(decodes), size)]
        for group in groups if tree_hidden_keys else []:
            hide_tree_keys(group, tree_hidden_keys)
        chunks, start = [], len(decodes)
        for n, num_computed, block_ids in prefills:
            chunks.append(self.prefill_chunk(start, n, num_computed, block_ids))
            start += n
        return AttentionMetadata(self._tensor(slot_mapping), groups, chunks)

    def decode_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping, [self._group(0, block_tables, seq_lens)], [])

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _rows(self, block_ids: torch.Tensor) -> torch.Tensor:
        return block_rows(block_ids, self.num_kv_heads, self.num_cache_blocks)

    def prefill_chunk(self, start: int, n: int, num_computed: int, block_ids: list[int]) -> PrefillChunk:
        table = self._tensor(block_ids[:cdiv(num_computed + n, self.block_size)])
        queries = torch.arange(num_computed, num_computed + n, device=self.device).unsqueeze(1)
        keys = torch.arange(len(table) * self.block_size if num_computed else n, device=self.device).unsqueeze(0)
        mask = keys <= queries if num_computed else None
        window = self.sliding_window
        window_mask = mask
        if window is not None and num_computed + n > window:  # HF: a query sees keys q - window < k <= q
            window_mask = (keys <= queries) & (keys > queries - window)
        return PrefillChunk(start, start + n, num_computed, table, self._rows(table), mask, window_mask)

    def decode_group(self, start: int, decodes: list[tuple[int, list[int]]]) -> DecodeGroup:
        return self._group(start, *self.tables_and_lengths(decodes))

    def tables_and_lengths(self, decodes: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables padded to the group's longest request (with block 0, masked out) and sequence lengths."""
        width = max(len(table) for _, table in decodes)
        tables = self._tensor([table + [0] * (width - len(table)) for _, table in decodes])
        return tables, self._tensor([seq_len for seq_len, _ in decodes])

    def _group(self, start: int, tables: torch.Tensor, seq_lens: torch.Tensor) -> DecodeGroup:
        group = DecodeGroup(start, start + tables.shape[0], tables, seq_lens)
        group.block_rows = self._rows(tables)
        keys = torch.arange(tables.shape[1] * self.block_size, device=tables.device).unsqueeze(0)
        group.mask = (keys < seq_lens.unsqueeze(1))[None, :, None, :]
        group.window_mask = group.mask
        if self.sliding_window is not None:
            group.window_mask = group.mask & (keys >= (seq_lens - self.sliding_window).unsqueeze(1))[None, :, None, :]
        return group

    # --- attention -------------------------------------------------------------------------------------------
    def forward(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        self.write(layer, k, v, meta.slot_mapping)
        if not meta.prefills and len(meta.decode_groups) == 1 and not meta.tree_groups:  # output as it comes
            return self.decode(layer, q, meta.decode_groups[0]).view(q.shape[0], -1)
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            out[group.start:group.end] = self.decode(layer, q[group.start:group.end], group)
        for group in meta.tree_groups:
            out[group.start:group.end] = TorchAttentionBackend.decode(self, layer, q[group.start:group.end], group)
        for chunk in meta.prefills:
            out[chunk.start:chunk.end] = self.prefill(layer, q, k, v, chunk)
        return out.view(q.shape[0], -1)

    def prefill(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                chunk: PrefillChunk) -> torch.Tensor:
        """One prompt chunk's queries [n, H, D] against its own keys and the context cached before it."""
        query = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
        mask = chunk.window_mask if layer.sliding_window else chunk.mask
        if chunk.mask is None:
            keys = k[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            values = v[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
        else:
            keys, values = gather_layer_kv(layer, chunk.block_rows, q.dtype)
            keys, values = keys.unsqueeze(0), values.unsqueeze(0)
        return attend(query, keys, values, mask, layer.scale, layer.softcap).squeeze(0).transpose(0, 1)

    @staticmethod
    def write(layer: Attention, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The new K/V rows into the layer's cache, in its dtype (float16 under a float32 model on the CPU): the
        first len(slot_mapping) rows, those someone reads later (all of them in a decode step)."""
        num_written = slot_mapping.shape[0]
        if not torch.compiler.is_compiling() and num_written < k.shape[0]:  # (a compiled decode step writes all)
            if not num_written:
                return
            k, v = k[:num_written], v[:num_written]
        if layer.k_scale is not None:
            write_kv(layer.k_cache, layer.k_scale, slot_mapping, k)
            write_kv(layer.v_cache, layer.v_scale, slot_mapping, v)
        elif torch.compiler.is_compiling():  # views made in the graph: one kept between calls would alias its input
            for cache, x in ((layer.k_cache, k), (layer.v_cache, v)):
                cache.view(layer.num_kv_heads, -1, layer.head_dim).index_copy_(1, slot_mapping,
                                                                              x.transpose(0, 1).to(cache.dtype))
        else:  # the same copies, through the layer's kept views
            layer.k_slots.index_copy_(0, slot_mapping, k.to(layer.k_slots.dtype))
            layer.v_slots.index_copy_(0, slot_mapping, v.to(layer.v_slots.dtype))

    def decode(self, layer: Attention, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """One query per request: scores [kv_heads, B, q_per_kv, L] from one batched matmul over gathered blocks."""
        batch = q.shape[0]
        q_per_kv = layer.num_heads // layer.num_kv_heads
        keys, values = gather_layer_kv(layer, group.block_rows, q.dtype)
        keys = keys.view(layer.num_kv_heads, batch, -1, layer.head_dim)
        values = values.view(layer.num_kv_heads, batch, -1, layer.head_dim)
        query = q.view(batch, layer.num_kv_heads, q_per_kv, layer.head_dim).transpose(0, 1)
        scores = torch.matmul(query, keys.transpose(-1, -2)).mul_(layer.scale)
        if layer.softcap is not None:
            scores = torch.tanh(scores.div_(layer.softcap)).mul_(layer.softcap)
        scores.masked_fill_(~(group.window_mask if layer.sliding_window else group.mask), float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1), values)  # [kv_heads, B, group, D]
        return out.transpose(0, 1).reshape(batch, layer.num_heads, layer.head_dim)


def hide_tree_keys(group: DecodeGroup, hidden_keys: dict[int, list[int]]) -> None:
    """Mask out, for the group's rows that are nodes of a draft tree, the keys of the other branches."""
    rows = [row for row in range(group.start, group.end) if row in hidden_keys]
    if not rows:
        return
    mask = group.mask.clone()
    for row in rows:
        mask[0, row - group.start, 0, hidden_keys[row]] = False
    group.window_mask = mask if group.window_mask is group.mask else group.window_mask & mask
    group.mask = mask


def gather_layer_kv(layer: Attention, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if layer.k_scale is None:
        return gather(layer.k_cache, rows).to(dtype), gather(layer.v_cache, rows).to(dtype)
    return (gather_kv(layer.k_cache, layer.k_scale, rows, dtype),
            gather_kv(layer.v_cache, layer.v_scale, rows, dtype))
