"""Whether an elementwise step runs as one fused native CPU kernel (kernels/fused_ops.cpp: RMSNorm with the residual
add, SiLU-and-multiply, rotary): in every CPU step where the kernels are built, eager and compiled alike. The compiled
decode step calls the same kernels rather than inductor's fusions of PyTorch's operators, so both compute the same
bits: their rounding differs in the last bit, which the next layer's int8 activations (the default model's kernels
re-quantize at every layer) turned into up to 0.2 of a logprob and different greedy tokens once the step switched."""
import torch

from inferno.kernels import fused_ops

# fused_ops() once looked up: by the first eager step, or by `resolve_fused_ops` before a trace (which must not trace
# into the kernel library's loading)
_RESOLVED: list = []


def resolve_fused_ops():
    """The `torch.ops.inferno` namespace holding the fused kernels, or None where they are not built; a compile calls
    it before it traces a model."""
    if not _RESOLVED:
        _RESOLVED.append(fused_ops())
    return _RESOLVED[0]


def cpu_fused_ops(x: torch.Tensor):
    """The `torch.ops.inferno` namespace for x's step, or None (on a GPU, or not built). Called several times per
    layer: the common case (a CPU step once the answer is known) first, at the cost of two attribute reads."""
    if not x.is_cpu:
        return None
    if _RESOLVED:
        return _RESOLVED[0]
    if torch.compiler.is_compiling():
        raise RuntimeError("a model is traced before resolve_fused_ops(): the trace would take the unfused path")
    return resolve_fused_ops()
