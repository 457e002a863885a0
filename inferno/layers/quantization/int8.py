"""int8 weights with float activations:
- per output channel (`Int8Linear`, group size PER_CHANNEL): absmax scales, `torch._weight_int8pack_mm` (fast only
  with bfloat16 activations: float32 ones are 10-50x slower on torch 2.13 CPU, so the layer computes in bfloat16);
- group-wise (`Int8GroupLinear`, the default): unsigned 8-bit codes with a float32 scale and min per group of
  32/64/128 input columns (w = q * scale + min, asymmetric), float32 activations, the native
  `inferno::int8_group_matmul` (kernels/quantized_gemv.cpp) for the few rows of a decode step. GGUF Q4_0 / Q4_1
  blocks of 32 load as they are (their 4-bit codes are 8-bit codes too), so the default model keeps its own
  weights."""
import torch
import torch.nn.functional as F
from torch import nn

from inferno.kernels import quantized_gemv
from inferno.layers.quantization.groups import GroupQuantized, quantize_groups, quantize_int8
from inferno.layers.quantization.linear import QuantizedLinear, float_rows


class Int8Linear(QuantizedLinear):
    """Per-output-channel int8 codes and bfloat16 scales; the dense GEMM from `gemm_from_rows` rows."""
    weight_format = "int8"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(*codes.shape, bias, native=True)  # PyTorch's own kernel
        self.register_buffer("weight", codes.contiguous())
        self.register_buffer("scales", scales.bfloat16())  # _weight_int8pack_mm is fast with bfloat16 only

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "Int8Linear":
        return cls(*quantize_int8(linear.weight.detach()), linear.bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.bfloat16(), self.weight, self.scales)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype` (the codes and the scales converted to it, then multiplied)."""
        return self.weight.to(dtype) * self.scales.to(dtype).unsqueeze(1)


class Int8GroupLinear(QuantizedLinear):
    """Group-wise int8 weights, float32 activations: the native kernel for decode-sized batches, dequantize-then-
    float32-GEMM from `gemm_from_rows` rows (or without a C++ compiler)."""
    weight_format = "int8_group"

    def __init__(self, weight: GroupQuantized, bias: torch.Tensor | None, in_features: int | None = None):
        """`weight` may have columns appended (up to a multiple of the group size) beyond `in_features`: they are
        dropped; the last group is then partial."""
        super().__init__(weight.codes.shape[0], in_features or weight.codes.shape[1], bias,
                         native=quantized_gemv() is not None)  # the kernel is built (and its torch.ops registered)
        self.group_size = weight.group_size
        self.register_buffer("weight", weight.codes[:, :self.in_features].contiguous())
        self.register_buffer("scales", weight.scales.float().contiguous())
        self.register_buffer("mins", weight.mins.float().contiguous())

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int) -> "Int8GroupLinear":
        w = linear.weight.detach()
        return cls(quantize_groups(w, group_size, bits=8), linear.bias, w.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`, computed in float32."""
        if self.native:
            w = torch.ops.inferno.int8_group_dequantize(self.weight, self.scales, self.mins, self.group_size)
            return w.to(dtype)
        n, k = self.weight.shape
        groups = self.scales.shape[1]
        codes = F.pad(self.weight, (0, groups * self.group_size - k)).view(n, groups, self.group_size)
        w = torch.addcmul(self.mins.unsqueeze(-1), codes, self.scales.unsqueeze(-1))
        return w.view(n, groups * self.group_size)[:, :k].to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.inferno.int8_group_matmul(float_rows(x), self.weight, self.scales, self.mins,
                                                   self.group_size)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """In float32 whatever the CPU (the weight exactly as the kernel computes it)."""
        return F.linear(float_rows(x), self.dequantize())
