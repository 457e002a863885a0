"""Linear layers on the CPU with their weight reordered once for oneDNN's inner product ("prepacked", as inductor's
freezing and vLLM's CPU backend do). For bfloat16, `F.linear` hands oneDNN the plain [N, K] weight, which it reorders
on every call: a decode step's matrix-vector products then stream ~28 GB/s where the prepacked weight streams ~43
(2 Zen 5 cores; a bfloat16 Qwen2.5-Coder-0.5B compiled decode step 47 -> 27 ms), and the same oneDNN kernel computes
both: the same bits. For float32, `F.linear` calls MKL, which streams 17 GB/s at one row and 5-9 GB/s at 16-64 rows
where oneDNN on the prepacked weight streams 41 / 34 / 13 (the same on an AVX2 cap): another kernel, so results equal
MKL's up to float32 rounding, not bit for bit.

The reordered weight is an opaque oneDNN tensor, which torch.compile cannot trace, so the native library keeps the
copies (ops.cpp, by the address of the weight each was made from) and the layers call `linear`: for a weight of a
packable dtype on the CPU the operator `inferno::dense_linear`, whose arguments are the plain weight (its shape is
all a compiled graph needs) and which runs on the weight's copy where `pack` made one; elsewhere plain `F.linear`.
Copies are made with the tiles when the runner is built (worker/tiles.py), and dropped with their weight. A
weight changed in place after that would not reach its copy: nothing in inferno does (the tiles of quantized weights
are copies likewise)."""
import weakref

import torch
import torch.nn.functional as F

from inferno.kernels import native_ops
from inferno.layers.fused_cpu import cpu_fused_ops

PACKED_DTYPES = (torch.bfloat16, torch.float32)


def packable(weight: torch.Tensor) -> bool:
    return (weight.dtype in PACKED_DTYPES and weight.device.type == "cpu" and weight.dim() == 2
            and weight.is_contiguous() and torch.backends.mkldnn.is_available()
            and (weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
            and native_ops() is not None)


def pack(weight: torch.Tensor) -> None:
    """Make `weight`'s oneDNN copy (laid out for a decode step's few rows), dropped with the weight."""
    ops = native_ops()
    if not ops.is_packed_linear_weight(weight):
        ops.pack_linear_weight(weight.detach())
        weakref.finalize(weight, ops.drop_packed_linear_weight, weight.data_ptr())


def is_packed(weight: torch.Tensor) -> bool:
    ops = native_ops()
    return ops is not None and ops.is_packed_linear_weight(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, on the packed copy of a CPU weight where there is one."""
    if (weight.dtype in PACKED_DTYPES and x.dtype == weight.dtype
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))):  # no backward there
        ops = cpu_fused_ops(x)  # the native library, looked up before a trace as for the fused kernels
        if ops is not None:
            return ops.dense_linear(x, weight, bias)
    return F.linear(x, weight, bias)
