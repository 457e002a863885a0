"""Rotary position embeddings (rotate-half layout), with Llama-3 frequency scaling."""
import math

import torch
from torch import nn

from inferno.config import RopeScaling


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None = None):
        super().__init__()
        # plain tensors on the CPU (not buffers): the model may be built on the meta device and then filled
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (theta ** exponents)
        if scaling is not None:
            inv_freq = llama3_scaled_inv_freq(inv_freq, scaling)
        self.inv_freq = inv_freq
        self.max_position = max_position
        self._build_cache()

    def _build_cache(self) -> None:
        t = torch.arange(self.max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, self.inv_freq)
        self.cos_cache = freqs.cos()
        self.sin_cache = freqs.sin()

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        """GGUF llama-3 files carry per-frequency divisors (`rope_freqs.weight`) instead of a config."""
        self.inv_freq = self.inv_freq / factors.float()
        self._build_cache()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cos/sin, shaped [T, 1, head_dim // 2] to broadcast over heads."""
        return self.cos_cache[positions].unsqueeze(1).to(dtype), self.sin_cache[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] in rotate-half layout."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
