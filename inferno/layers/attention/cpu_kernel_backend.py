"""The native CPU kernels (inferno/kernels/paged_attention.cpp, prefill_attention.cpp): read K/V through the block
tables in place, sliding windows included; all decode rows in one call, all prefill chunks in another (flash
attention over the context cached before each chunk and the chunk's own K/V as the cache holds them)."""
import torch

from inferno.core.kv_blocks import cdiv
from inferno.kernels import paged_attention
from inferno.layers.attention.layer import Attention
from inferno.layers.attention.metadata import AttentionMetadata, DecodeGroup, PackedPrefills
from inferno.layers.attention.torch_backend import TorchAttentionBackend, hide_tree_keys


class CpuKernelAttentionBackend(TorchAttentionBackend):
    name = "cpu_kernel"
    compiles_decode_step = True  # its kernels take every batch's ragged rows in one call: one graph for all sizes
    decode_group_size = None  # one group: the kernel takes ragged sequences as they are
    prefill_reads_new_kv = True  # a chunk's own K/V comes from k, v; only earlier context from the cache

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kernels = paged_attention()
        # the threads a decode row's keys are split for: the engine's, also where a step runs on fewer (while the
        # decode step compiles), so its bits never depend on when it ran
        self.threads = torch.get_num_threads()

    @staticmethod
    def supports(head_dim: int, quantized_kv: bool, softcap: float | None) -> str | None:
        """Why the kernel cannot run this model (None: it can): it reads float caches in 16-wide chunks of a head,
        without soft-capping."""
        if paged_attention() is None:
            return "the native kernel is not built"
        if quantized_kv:
            return "the KV cache is quantized"
        if head_dim % 16 or head_dim > 256:
            return f"head size {head_dim} is not a multiple of 16 up to 256"
        if softcap is not None:
            return "attention scores are soft-capped"
        return None

    def _group(self, start: int, tables: torch.Tensor, seq_lens: torch.Tensor) -> DecodeGroup:
        return DecodeGroup(start, start + tables.shape[0], tables, seq_lens)

    def build_metadata(self, slot_mapping: list[int], decodes: list[tuple[int, list[int]]],
                       prefills: list[tuple[int, int, list[int]]],
                       tree_hidden_keys: dict[int, list[int]] | None = None) -> AttentionMetadata:
        meta = super().build_metadata(slot_mapping, decodes, [])
        if prefills:
            meta.prefills = [self.packed_prefills(len(decodes), prefills)]
        if tree_hidden_keys:
            meta.tree_groups = self.tree_groups(decodes, tree_hidden_keys)
        return meta

    def tree_groups(self, decodes: list[tuple[int, list[int]]],
                    hidden_keys: dict[int, list[int]]) -> list[DecodeGroup]:
        """One masked PyTorch group per run of consecutive tree rows that hide keys (the kernel has no key mask;
        a tree's rows are few, so attending them again costs little next to the step's matmuls)."""
        rows, groups, start = sorted(hidden_keys), [], 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                first, end = rows[start], rows[i - 1] + 1
                group = TorchAttentionBackend._group(self, first, *self.tables_and_lengths(decodes[first:end]))
                hide_tree_keys(group, hidden_keys)
                groups.append(group)
                start = i
        return groups

    def packed_prefills(self, start: int, prefills: list[tuple[int, int, list[int]]]) -> PackedPrefills:
        query_start, seq_lens, tables = [0], [], []
        for n, num_computed, block_ids in prefills:
            query_start.append(query_start[-1] + n)
            seq_lens.append(num_computed + n)
            tables.append(block_ids[:cdiv(num_computed + n, self.block_size)])
        width = max(len(table) for table in tables)
        padded = self._tensor([table + [0] * (width - len(table)) for table in tables])
        return PackedPrefills(start, start + query_start[-1], padded, self._tensor(query_start),
                              self._tensor(seq_lens))

    def forward(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if meta.decode_groups or not meta.prefills:
            return super().forward(layer, q, k, v, meta)
        self.write(layer, k, v, meta.slot_mapping)  # prefills only: the kernel's output is the layer's, uncopied
        return self.prefill(layer, q, k, v, meta.prefills[0]).view(q.shape[0], -1)

    def prefill(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                chunks: PackedPrefills) -> torch.Tensor:
        rows = slice(chunks.start, chunks.end)
        q, k, v = q[rows], k[rows], v[rows]
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # the kernel reads a position's heads as one row
            q = q.contiguous()
        if layer.k_cache.dtype != k.dtype:
            # the chunk's own K/V rounded as the cache holds them (float16 under a float32 model), as later chunks
            # and decode steps read them: a prompt's attention is then the same bits however the batch chunks it
            k, v = k.to(layer.k_cache.dtype).to(k.dtype), v.to(layer.v_cache.dtype).to(v.dtype)
        return self.kernels.paged_prefill_attention(q, k, v, layer.k_cache, layer.v_cache,
                                                    chunks.block_tables, chunks.query_start, chunks.seq_lens,
                                                    layer.scale, layer.sliding_window or 0)

    def decode(self, layer: Attention, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        return self.kernels.paged_decode_attention(q.contiguous(), layer.k_cache, layer.v_cache, group.block_tables,
                                                   group.seq_lens, layer.scale, layer.sliding_window or 0,
                                                   self.threads)
