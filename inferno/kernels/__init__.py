"""Native CPU kernels, registered as `torch.ops.inferno.*` operators: built at install once per ISA level and loaded
for the CPU at hand (library.py; docs/kernels.md). Each function below returns the `torch.ops.inferno` namespace
holding its group of operators, or None when the kernel library is unavailable (the callers then take their PyTorch
paths, after one warning at the first call)."""
import functools

import torch

from inferno.kernels.fake_ops import Q8_WITH_MINS, TILE_ROWS, register_fake_ops
from inferno.kernels.library import KernelLibrary, kernel_cache_dir, load_kernel_library

__all__ = ["Q8_WITH_MINS", "TILE_ROWS", "KernelLibrary", "kernel_cache_dir", "kernel_library", "native_ops",
           "paged_attention", "quantized_gemv", "q4_k_gemv", "q6_k_gemv", "gguf_repack", "w8a8_activations",
           "fused_ops"]


@functools.cache
def kernel_library() -> KernelLibrary | None:
    """The loaded kernel library (its ISA level and file), with its operators' shapes for torch.compile."""
    library = load_kernel_library()
    if library is not None:
        register_fake_ops()
    return library


def native_ops():
    return torch.ops.inferno if kernel_library() is not None else None


def paged_attention():
    """`paged_decode_attention` and `paged_prefill_attention` (paged_attention.cpp, prefill_attention.cpp)."""
    return native_ops()


def quantized_gemv():
    """`int8_group_matmul` (float32 rows times group-wise int8 weights), `int8_group_dequantize`, `int8_q8_matmul` /
    `int4_q8_matmul` (rows quantized to int8 times signed int8 groups of 16 or 32 / group-wise int4) and their
    float32 / bfloat16 dequantizers `int8_q8_dequantize` / `int4_dequantize`, and the int4 and Q8 tiles `int4_tile` /
    `int4_tiles_matmul` / `q8_tile` / `q8_tiles_matmul` (quantized_gemv.cpp), and the Q5 tiles `q5_tile` /
    `q5_tiles_matmul` (q5_tiles.cpp)."""
    return native_ops()


def q4_k_gemv():
    """`q4_k_matmul`, `q4_k_dequantize`, `q4_k_tile` and `q4_k_tiles_matmul` (q4_k_gemv.cpp)."""
    return native_ops()


def q6_k_gemv():
    """`q6_k_matmul`, `q6_k_dequantize`, `q6_k_tile` and `q6_k_tiles_matmul` (q6_k_gemv.cpp)."""
    return native_ops()


def gguf_repack():
    """`gguf_to_int4` and `gguf_to_q8` (raw GGUF blocks -> the int4 kernel's rows / Q8Groups' codes, scales and
    mins) and `gguf_string_offsets` (gguf_repack.cpp)."""
    return native_ops()


def w8a8_activations():
    """`w8a8_quantize_rows` (a W8A8 projection's input scaled, rotated and quantized to bytes in one pass) and
    `w8a8_scale_rows` (its GEMM's output times the row scales, plus the bias; w8a8_activations.cpp)."""
    return native_ops()


def fused_ops():
    """The fused elementwise steps of CPU steps: `rms_norm`, `add_rms_norm`, `silu_and_mul` and `rotary`
    (fused_ops.cpp)."""
    return native_ops()
