"""bfloat16 linear layers on the CPU with their weight reordered once for oneDNN's inner product ("prepacked", as
inductor's freezing and vLLM's CPU backend do). `F.linear` hands oneDNN the plain [N, K] weight and oneDNN reorders
it on every call: a decode step's matrix-vector products then stream ~28 GB/s where the prepacked weight streams
~43 (2 Zen 5 cores, benchmarks/RESULTS.md `vs-vllm-*`). The same oneDNN kernel computes both: the same bits.

The reordered weight is an opaque oneDNN tensor, which torch.compile cannot trace, so the layers call `linear`: for
a bfloat16 weight on the CPU the operator `inferno::dense_linear`, whose arguments are the plain weight (its shape
is all the compiled graph needs) and which runs on the weight's packed copy where one was made (`pack`), looked up
by the weight's address; elsewhere plain `F.linear`. Copies are made by the runner's `TileSwitch` with the tiles,
before the first pass, and live as long as their weight. A weight changed in place after that would not reach its
copy: nothing in inferno does (the tiles of quantized weights are copies likewise)."""
import weakref

import torch
import torch.nn.functional as F

_PACKED: dict[int, torch.Tensor] = {}  # weight.data_ptr() -> its oneDNN copy


def packable(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.is_contiguous() and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> None:
    """Make `weight`'s oneDNN copy (its layout chosen for a decode step's few rows), dropped with the weight."""
    key = weight.data_ptr()
    if key not in _PACKED:
        _PACKED[key] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        weakref.finalize(weight, _PACKED.pop, key, None)


def is_packed(weight: torch.Tensor) -> bool:
    return weight.data_ptr() in _PACKED


@torch.library.custom_op("inferno::dense_linear", mutates_args=())
def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = _PACKED.get(weight.data_ptr())
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dense_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, on the packed copy of a bfloat16 CPU weight where there is one."""
    if (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and x.dtype == torch.bfloat16
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))):  # no backward here
        return dense_linear(x, weight, bias)
    return F.linear(x, weight, bias)
