"""RMSNorm. Gemma's (1 + w) form is the same norm: its loaders add the 1 to the checkpoint weight. The residual add
and the norm run as one kernel: Triton on CUDA, native in CPU steps, eager and compiled (layers/fused_cpu.py)."""
import torch
import torch.nn.functional as F
from torch import nn

from inferno.layers.fused_cpu import cpu_fused_ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self._fused(x)
        if ops is not None and x.dim() == 2:  # a flat batch's rows (every decoder norm): no views to make
            return ops.rms_norm(x, self.weight, self.eps)
        if ops is not None:
            return ops.rms_norm(x.view(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # normalise in float32 like the reference implementation, then scale in the model dtype
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def _fused(self, x: torch.Tensor):
        """The native CPU kernels where they take x as it is (contiguous, the weight's dtype), else None."""
        if not x.is_contiguous() or x.dtype != self.weight.dtype:
            return None
        return cpu_fused_ops(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm block's residual stream and the next block's input."""
        if x.is_cuda and x.dim() == 2:
            from inferno.kernels.triton_fused import fused_add_rms_norm
            return fused_add_rms_norm(x, self.weight, self.eps, residual)
        ops = self._fused(x)
        if ops is not None and residual.is_contiguous() and residual.dtype == x.dtype and x.dim() == 2:
            return ops.add_rms_norm(x, residual, self.weight, self.eps)
        if ops is not None and residual.is_contiguous() and residual.dtype == x.dtype:
            out, total = ops.add_rms_norm(x.view(-1, x.shape[-1]), residual.view(-1, x.shape[-1]), self.weight,
                                          self.eps)
            return out.view(x.shape), total.view(x.shape)
        total = residual + x
        return self(total), total
