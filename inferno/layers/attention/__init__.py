"""Paged attention: the `Attention` layer (a layer's KV cache) and the backends that compute it — PyTorch
(`torch_backend`), the native CPU decode kernel (`cpu_kernel_backend`) and Triton (`triton_backend`, the GPU's).
A backend builds its own metadata for a step from the flat batch and computes every layer with it."""
from inferno.layers.attention.backend import AttentionBackend
from inferno.layers.attention.layer import Attention
from inferno.layers.attention.selector import ATTENTION_BACKENDS, select_attention_backend

__all__ = ["ATTENTION_BACKENDS", "Attention", "AttentionBackend", "select_attention_backend"]
