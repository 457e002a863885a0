"""The attention layer: one layer's paged KV cache and its shape; the backend chosen for the model computes it."""
import torch
from torch import nn


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
        self.backend = None  # the model's AttentionBackend, set by the model runner with the caches

    # The caches, and the same as [slots, kv_heads, head_dim] (strided views: the caches are head-major), where a
    # step's new K/V rows go by slot: made once with each cache, not at every layer of every step
    @property
    def k_cache(self) -> torch.Tensor | None:
        return self._k_cache

    @k_cache.setter
    def k_cache(self, cache: torch.Tensor | None) -> None:
        self._k_cache, self.k_slots = cache, self._slots(cache)

    @property
    def v_cache(self) -> torch.Tensor | None:
        return self._v_cache

    @v_cache.setter
    def v_cache(self, cache: torch.Tensor | None) -> None:
        self._v_cache, self.v_slots = cache, self._slots(cache)

    def _slots(self, cache: torch.Tensor | None) -> torch.Tensor | None:
        return None if cache is None else cache.view(self.num_kv_heads, -1, self.head_dim).transpose(0, 1)

    def copy_blocks(self, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Copy-on-write: whole blocks of this layer's cache, `sources[i]` to `destinations[i]`."""
        for cache in self._indexable_caches():
            cache[:, destinations] = cache[:, sources]

    def move_slots(self, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Single token slots of this layer's cache, `sources[i]` to `destinations[i]` (a draft tree's accepted
        path, moved to consecutive positions); each source is read before any destination is written."""
        for cache in self._indexable_caches():
            slots = cache.view(cache.shape[0], -1, *cache.shape[3:])  # [kv_heads, slots, ...]
            slots[:, destinations] = slots[:, sources]

    def _indexable_caches(self) -> tuple[torch.Tensor, ...]:
        """K and V, or a quantized cache's codes as bytes (CPU indexing has no fp8 kernel) and their scales."""
        if self.k_scale is None:
            return self.k_cache, self.v_cache
        return self.k_cache.view(torch.uint8), self.v_cache.view(torch.uint8), self.k_scale, self.v_scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H * D]: the new K/V written to the cache, then attention through it."""
        return self.backend.forward(self, q, k, v, meta)
