"""Rotary position embeddings with Llama-3, linear and LongRoPE (Phi-3) frequency scaling.

Q/K head dimensions are kept in the interleaved layout (rotation pairs are adjacent: dims 2i, 2i+1), so the
rotation of pair i by angle a_i is (x0 cos - x1 sin, x0 sin + x1 cos), written with real tensors so that
`torch.compile` fuses it into one kernel. Loaders convert checkpoints in Hugging Face's rotate-half layout with
`interleave_rotary_rows`; q·k is unchanged because queries and keys are permuted alike.
"""
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
        self.scaling = scaling
        if scaling is not None and scaling.rope_type == "llama3":
            inv_freq = llama3_scaled_inv_freq(inv_freq, scaling)
        elif scaling is not None and scaling.rope_type == "linear":
            inv_freq = inv_freq / scaling.factor
        self.inv_freq = inv_freq
        self.max_position = max_position
        self._build_cache()

    def _build_cache(self) -> None:
        t = torch.arange(self.max_position, dtype=torch.float32, device="cpu")
        scaling = self.scaling
        if scaling is not None and scaling.rope_type == "longrope":
            # LongRoPE: per-frequency divisors, the long ones when the context goes beyond the original (llama.cpp's
            # choice, one for the whole model: HF switches per forward pass by its longest sequence, which leaves a
            # cache of keys rotated one way and queries the other once a sequence crosses the original length)
            long = self.max_position > scaling.original_max_position_embeddings
            factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, device="cpu")
            freqs = torch.outer(t, self.inv_freq / factors)
            cos_sin = torch.stack([freqs.cos(), freqs.sin()], dim=-1) * scaling.attention_factor
        else:
            freqs = torch.outer(t, self.inv_freq)
            cos_sin = torch.stack([freqs.cos(), freqs.sin()], dim=-1)
        self.cos_sin_cache = cos_sin  # [positions, head_dim // 2, 2]

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        """GGUF llama-3 files carry per-frequency divisors (`rope_freqs.weight`) instead of a config."""
        self.inv_freq = self.inv_freq / factors.float()
        self._build_cache()

    def rotations(self, positions: torch.Tensor) -> torch.Tensor:
        """Per-token (cos, sin) of every pair's angle, [T, 1, head_dim // 2, 2] to broadcast over heads."""
        return self.cos_sin_cache[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] in the interleaved layout -> rotated copy."""
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = rotations.unbind(-1)
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).to(x.dtype)


def interleave_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of a Q/K projection (weight or bias) from rotate-half order to interleaved order, per head."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
