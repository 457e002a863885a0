"""Medusa heads (Cai et al. 2024): small residual blocks over the target's last hidden state (after its final norm),
one stack per head, each ending in an LM head; head j predicts the token j + 2 positions after the hidden state's
(the target's own LM head predicts the next one)."""
import torch
from torch import nn


class ResidualBlock(nn.Module):
    """x + SiLU(W x + b)."""

    def __init__(self, hidden_size: int, bias: bool = True):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """`num_heads` stacks of `num_layers` residual blocks; `lm_heads` None: every head ends in the target's LM head
    (passed to `logits`)."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int, own_lm_heads: bool,
                 bias: bool = True):
        super().__init__()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.blocks = nn.ModuleList(nn.Sequential(*(ResidualBlock(hidden_size, bias) for _ in range(num_layers)))
                                    for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False)
                                      for _ in range(num_heads)) if own_lm_heads else None

    def logits(self, hidden: torch.Tensor, base_lm_head: nn.Module | None = None,
               num_heads: int | None = None) -> torch.Tensor:
        """[heads, T, vocab] float32 logits of the first `num_heads` heads (default all) for normed hidden states
        [T, hidden]."""
        heads = range(num_heads or self.num_heads)
        if self.lm_heads is not None:
            return torch.stack([self.lm_heads[j](self.blocks[j](hidden)).float() for j in heads])
        # one pass of the shared LM head over every head's rows: its weight (most of the cost) is read once
        shifted = torch.cat([self.blocks[j](hidden) for j in heads])
        return base_lm_head(shifted).float().view(len(heads), hidden.shape[0], -1)
