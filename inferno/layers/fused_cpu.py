"""Whether an elementwise step runs as one fused native CPU kernel (kernels/fused_ops.cpp: RMSNorm with the residual
add, SiLU-and-multiply, rotary in place): in eager CPU steps (prefill, and decode until its graph is compiled) where
the kernels are built. A step that torch.compile traces keeps PyTorch's operators, which inductor fuses itself."""
import torch

from inferno.kernels import fused_ops


def cpu_fused_ops(x: torch.Tensor):
    """The `torch.ops.inferno` namespace for x's step, or None (on a GPU, while compiling, or not built)."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return fused_ops()
