"""RMSNorm. Gemma's (1 + w) form is the same norm: its loaders add the 1 to the checkpoint weight."""
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
