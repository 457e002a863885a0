"""The native CPU kernels (inferno/kernels/paged_attention.cpp, prefill_attention.cpp): read K/V through the block
tables in place, sliding windows included; all decode rows in one call, each prefill chunk in one call (flash
attention over the context cached before the chunk and the chunk's own K/V as computed)."""
import torch

from inferno.core.kv_blocks import cdiv
from inferno.kernels import paged_attention
from inferno.layers.attention.layer import Attention
from inferno.layers.attention.metadata import DecodeGroup, PrefillChunk
from inferno.layers.attention.torch_backend import TorchAttentionBackend


class CpuKernelAttentionBackend(TorchAttentionBackend):
    name = "cpu_kernel"
    compiles_decode_step = True  # its kernels take every batch's ragged rows in one call: one graph for all sizes
    decode_group_size = None  # one group: the kernel takes ragged sequences as they are

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kernels = paged_attention()

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

    def prefill_chunk(self, start: int, n: int, num_computed: int, block_ids: list[int]) -> PrefillChunk:
        return PrefillChunk(start, start + n, num_computed,
                            self._tensor(block_ids[:cdiv(num_computed + n, self.block_size)]))

    def prefill(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                chunk: PrefillChunk) -> torch.Tensor:
        rows = slice(chunk.start, chunk.end)
        return self.kernels.paged_prefill_attention(q[rows].contiguous(), k[rows], v[rows], layer.k_cache,
                                                    layer.v_cache, chunk.block_table, chunk.num_computed_tokens,
                                                    layer.scale, layer.sliding_window or 0)

    def decode(self, layer: Attention, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        return self.kernels.paged_decode_attention(q.contiguous(), layer.k_cache, layer.v_cache, group.block_tables,
                                                   group.seq_lens, layer.scale, layer.sliding_window or 0)
