"""Whether an elementwise step runs as one fused native CPU kernel (kernels/fused_ops.cpp: RMSNorm with the residual
add, SiLU-and-multiply, rotary): in every CPU step where the kernels are built, eager and compiled alike. The compiled
decode step calls the same kernels rather than inductor's fusions of PyTorch's operators, so both compute the same
bits: their rounding differs in the last bit, which the next layer's int8 activations (the default model's kernels
re-quantize at every layer) turned into up to 0.2 of a logprob and different greedy tokens once the step switched."""
import torch

from inferno.kernels import fused_ops


# fused_ops() as the eager steps found it, for the compiled one: dynamo would trace into its build (the model runner
# runs an eager step before it compiles)
EAGER_ANSWER: list = []


def cpu_fused_ops(x: torch.Tensor):
    """The `torch.ops.inferno` namespace for x's step, or None (on a GPU, or not built). Called several times per
    layer: the common case (a CPU step once the answer is known) first, at the cost of two attribute reads."""
    if not x.is_cpu:
        return None
    if EAGER_ANSWER:
        return EAGER_ANSWER[0]
    if torch.compiler.is_compiling():
        return None
    EAGER_ANSWER.append(fused_ops())
    return EAGER_ANSWER[0]
