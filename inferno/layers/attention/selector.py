"""Which attention backend runs a model: chosen once per model runner, from the device, the model and the cache.

"auto" picks Triton on CUDA, the native CPU kernel on the CPU where it can run the model, and the PyTorch backend
otherwise (quantized caches, head sizes the kernel does not tile, soft-capped scores on the CPU). Asking for a
backend that cannot run the model is an error that says why.
"""
import importlib.util
import logging

import torch

from inferno.config import ATTENTION_BACKENDS
from inferno.layers.attention.backend import AttentionBackend

logger = logging.getLogger("inferno")


def select_attention_backend(name: str, device: torch.device, block_size: int, num_kv_heads: int,
                             num_cache_blocks: int, head_dim: int, sliding_window: int | None, quantized_kv: bool,
                             softcap: float | None) -> AttentionBackend:
    from inferno.layers.attention.cpu_kernel_backend import CpuKernelAttentionBackend
    from inferno.layers.attention.torch_backend import TorchAttentionBackend
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        else:
            why_not = CpuKernelAttentionBackend.supports(head_dim, quantized_kv, softcap)
            name = "cpu_kernel" if why_not is None else "torch"
            if why_not is not None:
                logger.info("attention runs on the PyTorch path: %s", why_not)
    torch_args = (block_size, num_kv_heads, num_cache_blocks, sliding_window, device)
    if name == "torch":
        return TorchAttentionBackend(*torch_args)
    if name == "cpu_kernel":
        why_not = "it runs on the CPU only" if device.type != "cpu" else CpuKernelAttentionBackend.supports(
            head_dim, quantized_kv, softcap)
        if why_not is not None:
            raise ValueError(f"attention_backend 'cpu_kernel' cannot run this model: {why_not}")
        return CpuKernelAttentionBackend(*torch_args)
    if importlib.util.find_spec("triton") is None:
        raise ValueError("attention_backend 'triton' needs the triton package (pip install triton)")
    from inferno.layers.attention.triton_backend import TritonAttentionBackend
    why_not = TritonAttentionBackend.supports(head_dim, quantized_kv)
    if why_not is not None:
        raise ValueError(f"attention_backend 'triton' cannot run this model: {why_not}")
    return TritonAttentionBackend(block_size, device)
