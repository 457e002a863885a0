"""The gated feed-forward block: down(act(gate(x)) * up(x)), SiLU (SwiGLU) or tanh-approximated GELU (GeGLU)."""
import torch
import torch.nn.functional as F
from torch import nn

from inferno.distributed.parallel_state import ParallelRank
from inferno.layers.fused_cpu import cpu_fused_ops
from inferno.layers.lora import LoRAMapping, LoRAStack, add_lora
from inferno.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class MLP(nn.Module):
    """`reduce=False` leaves the tensor-parallel all-reduce of the output to the caller (experts of a MoE block)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, parallel: ParallelRank,
                 reduce: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, intermediate_size, parallel)
        self.down_proj = RowParallelLinear(intermediate_size, self.gate_up_proj.shards[0], hidden_size, parallel,
                                           reduce)
        self.act = activation(hidden_act)
        self.silu = hidden_act == "silu"
        self.gate_up_lora: LoRAStack | None = None  # set when the engine serves LoRA adapters (model/lora.py)
        self.down_lora: LoRAStack | None = None

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is None:
            return self.down_proj(self.gated_activation(gate_up))
        h = self.gated_activation(add_lora(gate_up, x, self.gate_up_lora, lora))
        return add_lora(self.down_proj(h), h, self.down_lora, lora)

    def gated_activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.silu and gate_up.is_cuda:  # one Triton kernel
            from inferno.kernels.triton_fused import silu_and_mul
            return silu_and_mul(gate_up)
        ops = cpu_fused_ops(gate_up) if self.silu and gate_up.is_contiguous() else None
        if ops is not None and gate_up.dim() == 2:  # one native kernel
            return ops.silu_and_mul(gate_up)
        if ops is not None:
            return ops.silu_and_mul(gate_up.view(-1, gate_up.shape[-1])).view(
                *gate_up.shape[:-1], gate_up.shape[-1] // 2)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up
