"""The native CPU decode kernel (inferno/kernels/paged_attention.cpp): reads K/V through the block tables in place,
all decode rows in one call, sliding windows included; prefills as in the PyTorch backend."""
import torch

from inferno.kernels import paged_attention
from inferno.layers.attention.layer import Attention
from inferno.layers.attention.metadata import DecodeGroup
from inferno.layers.attention.torch_backend import TorchAttentionBackend


class CpuKernelAttentionBackend(TorchAttentionBackend):
    name = "cpu_kernel"
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

    def decode(self, layer: Attention, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        return self.kernels.paged_decode_attention(q.contiguous(), layer.k_cache, layer.v_cache, group.block_tables,
                                                   group.seq_lens, layer.scale, layer.sliding_window or 0)
