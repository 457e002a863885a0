"""Quantized KV cache: int8 or fp8 (e4m3) codes with one float32 scale per token per KV head.

A layer's cache is then a pair: codes `[kv_heads, num_blocks, block_size, head_dim]` and scales
`[kv_heads, num_blocks, block_size]`; a cached vector is `codes * scale` (absmax scaling: the largest element of
each token's head vector maps to the format's largest value).
"""
import torch

from inferno.config import DTYPES

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def kv_element_bytes(kv_cache_dtype: str, head_dim: int) -> float:
    """Bytes per cached K or V element (`kv_cache_dtype` a resolved EngineConfig.kv_cache_dtype), the per-token
    scale included."""
    if kv_cache_dtype in KV_CACHE_DTYPES:
        return 1 + 4 / head_dim
    return DTYPES[kv_cache_dtype].itemsize


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> codes [..., head_dim] in `dtype`, scales [...] float32."""
    scales = x.float().abs().amax(dim=-1).clamp(min=1e-8) / CODE_MAX[dtype]
    scaled = x.float() / scales.unsqueeze(-1)
    if dtype == torch.int8:
        scaled = scaled.round_()
    return scaled.to(dtype), scales


def write_kv(cache: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """x [T, kv_heads, head_dim] into the slots of a quantized cache."""
    kv_heads, _, _, head_dim = cache.shape
    codes, x_scales = quantize_kv(x.transpose(0, 1), cache.dtype)
    # index_copy_ has no fp8 kernel on CPU: copy fp8 codes as their bytes
    cache.view(torch.uint8).view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, codes.view(torch.uint8))
    scales.view(kv_heads, -1).index_copy_(1, slot_mapping, x_scales)


def gather_kv(cache: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantized [kv_heads, tokens, head_dim] in `dtype` for the cache rows `rows` (see attention.block_rows)."""
    kv_heads, num_blocks, block_size, head_dim = cache.shape
    codes = cache.view(torch.uint8).view(kv_heads * num_blocks, block_size * head_dim).index_select(0, rows)
    row_scales = scales.view(kv_heads * num_blocks, block_size).index_select(0, rows)
    values = codes.view(cache.dtype).view(kv_heads, -1, head_dim).to(dtype)
    return values * row_scales.view(kv_heads, -1, 1).to(dtype)
