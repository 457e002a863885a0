"""quantization="int8" / "int4": a float model's projections swapped for quantized layers at load."""
from torch import nn

from inferno.config import PER_CHANNEL
from inferno.layers.quantization.groups import LM_HEAD_GROUP_SIZE, GroupQuantized, quantize_groups_symmetric
from inferno.layers.quantization.int4 import Int4Linear
from inferno.layers.quantization.int8 import Int8GroupLinear, Int8Linear
from inferno.layers.quantization.q8 import Q8Linear


def quantize_linears(model: nn.Module, method: str, group_size: int,
                     prequantized: dict[str, GroupQuantized] | None = None) -> None:
    """Swap every projection of the decoder layers for its quantized form, and the LM head for symmetric int8
    groups of LM_HEAD_GROUP_SIZE: with float32 activations in the (exact) group-wise int8 model, with activations
    quantized to int8 (Q8Linear) in the int4 and per-channel int8 models.

    `method` "int8" with `group_size` PER_CHANNEL is the per-channel form. `prequantized` maps a layer's name to
    4-bit codes read straight from the checkpoint (GGUF Q4_0/Q4_1 with blocks of `group_size`); those are packed
    as they are (int4) or taken as 8-bit codes (group-wise int8), the rest are quantized from their float weights.
    The quantized layers hold whole weights and do no all-reduce: one tensor-parallel rank only (each pipeline
    stage quantizes the layers it holds).
    """
    prequantized = prequantized or {}
    grouped_int8 = method == "int8" and group_size != PER_CHANNEL
    for name, module in list(model.named_modules()):
        if name == "lm_head" and grouped_int8:  # a (single-rank) ParallelLMHead: logits = hidden @ weight.t()
            quantized = Int8GroupLinear(quantize_groups_symmetric(module.weight.detach(), LM_HEAD_GROUP_SIZE), None,
                                        module.weight.shape[1])
        elif name == "lm_head":
            quantized = Q8Linear.from_float(module.weight)
        elif not isinstance(module, nn.Linear):
            continue
        elif grouped_int8 and name in prequantized:
            quantized = Int8GroupLinear(prequantized[name], module.bias)
        elif grouped_int8:
            quantized = Int8GroupLinear.from_float(module, group_size)
        elif method == "int8":
            quantized = Int8Linear.from_float(module)
        elif name in prequantized:
            quantized = Int4Linear(prequantized[name], module.bias)
        else:
            quantized = Int4Linear.from_float(module, group_size)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, quantized)
