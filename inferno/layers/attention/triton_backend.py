"""The GPU attention backend: Triton kernels (inferno/kernels/triton_attention.py) that write new K/V by slot and
read the paged cache through block tables — decode rows in one flash-decoding launch, prefill chunks (with
their cached context) in one variable-length launch. Float caches (float32, bfloat16, float16)."""
from dataclasses import dataclass

import torch

from inferno.core.kv_blocks import cdiv
from inferno.kernels import triton_attention
from inferno.layers.attention.backend import AttentionBackend
from inferno.layers.attention.layer import Attention


@dataclass(slots=True)
class TritonMetadata:
    slot_mapping: torch.Tensor  # [T] long; negative: padding, nothing written
    num_decodes: int  # decode rows first in the flat batch, then the prefill chunks' rows
    decode_block_tables: torch.Tensor  # [num_decodes, width] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32
    prefill_block_tables: torch.Tensor  # [chunks, width] int32
    prefill_query_start: torch.Tensor  # [chunks + 1] int32, from 0 (rows after the decodes)
    prefill_seq_lens: torch.Tensor  # [chunks] int32: tokens cached before the chunk + the chunk's
    max_prefill_len: int


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    captures_decode_graphs = True
    masks_tree_keys = False  # its kernels have no per-query key mask

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device

    @staticmethod
    def supports(head_dim: int, quantized_kv: bool) -> str | None:
        if quantized_kv:
            return "the KV cache is quantized"
        if not 16 <= head_dim <= 256:
            return f"head size {head_dim} is outside 16..256"
        return None

    def build_metadata(self, slot_mapping: list[int], decodes: list[tuple[int, list[int]]],
                       prefills: list[tuple[int, int, list[int]]],
                       tree_hidden_keys: dict[int, list[int]] | None = None) -> TritonMetadata:
        if tree_hidden_keys:
            raise NotImplementedError("draft trees are not verified on the triton attention backend (its kernels "
                                      "have no per-query key mask): leave speculative_token_tree out on GPUs")
        starts, seq_lens, tables = [0], [], []
        for n, num_computed, block_ids in prefills:
            starts.append(starts[-1] + n)
            seq_lens.append(num_computed + n)
            tables.append(block_ids[:cdiv(num_computed + n, self.block_size)])
        return TritonMetadata(
            self._tensor(slot_mapping, torch.long), len(decodes), self._table([t for _, t in decodes]),
            self._tensor([n for n, _ in decodes]), self._table(tables), self._tensor(starts), self._tensor(seq_lens),
            max((n for n, _, _ in prefills), default=0))

    def decode_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor) -> TritonMetadata:
        no_prefills = seq_lens[:0]
        return TritonMetadata(slot_mapping, block_tables.shape[0], block_tables, seq_lens, block_tables[:0],
                              no_prefills, no_prefills, 0)

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _table(self, tables: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in tables), default=1)
        return self._tensor([t + [0] * (width - len(t)) for t in tables]).view(len(tables), width)

    def forward(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TritonMetadata) -> torch.Tensor:
        triton_attention.write_kv(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping)
        window = layer.sliding_window or 0
        out = torch.empty_like(q)
        n = meta.num_decodes
        if n:
            out[:n] = triton_attention.paged_decode_attention(
                q[:n], layer.k_cache, layer.v_cache, meta.decode_block_tables, meta.decode_seq_lens, layer.scale,
                window, layer.softcap)
        if meta.max_prefill_len:
            triton_attention.paged_prefill_attention(
                q[n:], layer.k_cache, layer.v_cache, meta.prefill_block_tables, meta.prefill_query_start,
                meta.prefill_seq_lens, meta.max_prefill_len, layer.scale, window, layer.softcap, out=out[n:])
        return out.view(q.shape[0], -1)
