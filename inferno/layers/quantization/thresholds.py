"""From how many rows a quantized layer runs a GEMM instead of its matrix-vector kernel (`QuantizedLinear`), per
weight format and the instruction set of the CPU this process runs on, and the dtype of the GEMMs on dequantized
weights. Read when a layer is made, so they follow `inferno.cpu_features` (INFERNO_CPU_ISA's cap included)."""
import torch

from inferno.cpu_features import cpu_flags, has_native_bfloat16

# Per format, the rows from which the GEMM runs: (with the kernels' AVX-512 paths, elsewhere). The kernels' paths,
# and the dense dtype, differ per CPU (quantized_gemv.cpp):
# - int8 per channel (`_weight_int8pack_mm`), 3072x576 weight, 512 rows, one core: 41-45 ms against 4 ms
#   dequantize-then-GEMM; the crossover is near 32 rows.
# - AVX-512: int4 (96) measured against PyTorch's int4 kernel before the VNNI kernel replaced it; group-wise int8,
#   the 4 projections of one SmolLM2 layer, one core: 16 rows 2.41 ms against 2.48, 32 rows 5.1 against 3.1; the
#   Q8_0 LM head (49152x576), one core: 64 rows 37 ms against 89, 256 rows 150 against 103 (bfloat16 GEMM).
# - AVX2 (float32 GEMM), ms of CPU per decode step of SmolLM2-135M's projections, one thread (benchmarks/
#   kernels.py --projections --cpu-time): int4 64 rows 259 against 651, 256 rows 963 against 1303; Q8_0 256 rows
#   1015 against 1102; group-wise int8 64 rows 462 against 478, 128 rows 1048 against 644. Per row the int4 and Q8
#   kernels cost about what the float32 GEMM does, so the dequantization never pays back below a few hundred rows.
# - Q4_K, AVX-512 (bfloat16 GEMM), 2 threads, random weights: Qwen2.5-1.5B's fused gate/up (17920 x 1536) 11.8
#   against 21.4 ms at 64 rows, 37.6 against 32.5 at 256; its down_proj (1536 x 8960) crosses earlier (8.3 against
#   3.6 ms at 64 rows: large K), as Q6_K's does. AVX2: Q6_K's crossover, not measured for Q4_K.
# - Q6_K, AVX-512 (bfloat16 GEMM), one thread, CPU time: the four projections of Qwen2.5-1.5B's layers as Q6_K
#   (`python kernels.py --projections qwen2.5-1.5b --kinds q6_k_blocks --rows 32 48 64 --cpu-time`) 1404 against
#   3091 ms per step at 32 rows, 1923 against 3252 at 48, 2793 against 3305 at 64; its ffn_down alone (1536 x 8960,
#   the Q6_K projection of Q4_K_M files) crosses earlier: 23.6 against 23.7 ms at 40 rows, 28.8 against 25.0 at 48.
#   AVX2: Q8's crossover, not measured for Q6_K.
# - W8A8: from 16 rows the int8 x int8 GEMM; below, the per-row overhead of quantizing the activations dominates
#   and the same codes run weight-only (`_weight_int8pack_mm`).
GEMM_FROM_ROWS = {
    "int8": (32, 32),
    "int8_group": (16, 64),
    "int4": (96, 512),
    "q8": (160, 512),
    "q4_k": (96, 512),
    "q6_k": (64, 512),
    "w8a8": (16, 16),
}


def avx512_kernels() -> bool:
    """The native kernels run their AVX-512 paths (AVX-512 VNNI and BW, not capped by INFERNO_CPU_ISA)."""
    return {"avx512_vnni", "avx512bw"} <= cpu_flags()


def gemm_from_rows(weight_format: str) -> int:
    """The rows from which a layer of `weight_format` (a key of GEMM_FROM_ROWS) runs its GEMM on this CPU."""
    avx512, elsewhere = GEMM_FROM_ROWS[weight_format]
    return avx512 if avx512_kernels() else elsewhere


def compute_dtype() -> torch.dtype:
    """The GEMMs on dequantized weights (prefill, large batches): bfloat16 where the CPU has native instructions for
    it (AVX512-BF16, AMX), float32 elsewhere (AVX2 has none: PyTorch's emulated bfloat16 GEMM is slower than
    float32 there)."""
    return torch.bfloat16 if has_native_bfloat16() else torch.float32
