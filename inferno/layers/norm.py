"""RMSNorm. Gemma's (1 + w) form is the same norm: its loaders add the 1 to the checkpoint weight. On CUDA the
residual add and the norm run as one Triton kernel."""
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # normalise in float32 like the reference implementation, then scale in the model dtype
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm block's residual stream and the next block's input."""
        if x.is_cuda and x.dim() == 2:
            from inferno.kernels.triton_fused import fused_add_rms_norm
            return fused_add_rms_norm(x, self.weight, self.eps, residual)
        total = residual + x
        return self(total), total
