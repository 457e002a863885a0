"""W8A8: int8 weights and int8 activations with calibrated static thresholds, for prefill-sized batches.

Weights: symmetric per output channel (absmax). Activations: one clipping threshold T per layer input, calibrated
on sample text (activation_calibration.py): x ≈ clamp(round(x · 127 / T), ±127) · T / 127, stored as unsigned
bytes with zero point 128. The product runs in integers in oneDNN's u8 x s8 GEMM (`torch.ops.onednn.
qlinear_pointwise`, float32 out, per-channel weight scales applied there); `torch._int_mm` is a plain loop on CPU
(about 30x slower than the float32 GEMM, benchmarks/RESULTS.md).

Without VNNI the GEMM multiplies with `vpmaddubsw`, which adds two u8 x s8 products in a saturating int16:
255 · 127 · 2 overflows it. There the weights get 7-bit codes (±63; 255 · 63 · 2 < 2^15, exact) and the
activations keep all 8 bits, since their outliers are what int8 struggles with. With AVX-512 VNNI or AVX-VNNI the
products accumulate in int32 and the weights keep ±127.

Decode-sized batches (fewer than W8A8_FROM_ROWS rows) stay weight-only: the same int8 codes through
`torch._weight_int8pack_mm` with bfloat16 activations (per-row overhead of the quantized GEMM dominates there).
"""
import torch
import torch.nn.functional as F
from torch import nn

from inferno.cpu_features import cpu_flags

W8A8_FROM_ROWS = 16
ACTIVATION_LEVELS = 127
ACTIVATION_ZERO_POINT = 128
WEIGHT_LEVELS = 127 if {"avx512_vnni", "avx_vnni"} & cpu_flags() else 63


class W8A8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, threshold: float):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / WEIGHT_LEVELS
        self.register_buffer("weight", torch.round(w / scales.unsqueeze(1)).clamp(-WEIGHT_LEVELS, WEIGHT_LEVELS)
                             .to(torch.int8).contiguous())
        self.register_buffer("scales", scales)
        self.register_buffer("scales_bf16", scales.bfloat16())  # _weight_int8pack_mm is fast with bfloat16 only
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.register_buffer("weight_zero_points", torch.zeros(self.out_features, dtype=torch.long))
        self.threshold = threshold
        self.input_scale = threshold / ACTIVATION_LEVELS
        self.native = torch.backends.mkldnn.is_available()
        self.packed = torch.ops.onednn.qlinear_prepack(self.weight, None) if self.native else None

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """[M, K] float -> uint8 codes (zero point 128), clipped at ±threshold."""
        codes = torch.round(x.float() / self.input_scale).clamp_(-ACTIVATION_LEVELS, ACTIVATION_LEVELS)
        return (codes + ACTIVATION_ZERO_POINT).to(torch.uint8)

    def int8_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The integer product of quantized x and the weight codes, scaled to float32 [M, N] (plus bias)."""
        codes = self.quantize_input(x)
        if self.native:
            return torch.ops.onednn.qlinear_pointwise(
                codes, self.input_scale, ACTIVATION_ZERO_POINT, self.packed, self.scales, self.weight_zero_points,
                self.bias, 1.0, 0, torch.float32, "none", [], "")
        x_dequantized = (codes.float() - ACTIVATION_ZERO_POINT) * self.input_scale
        return F.linear(x_dequantized, self.weight.float() * self.scales.unsqueeze(1), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] >= W8A8_FROM_ROWS:
            y = self.int8_matmul(x2)
        else:
            y = torch._weight_int8pack_mm(x2.bfloat16(), self.weight, self.scales_bf16).float()
            y = y if self.bias is None else y + self.bias
        return y.view(*shape[:-1], self.out_features).to(x.dtype)


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The projections of the decoder layers (fused QKV and gate/up, O, down, experts), by name in the model."""
    return {name: m for name, m in model.named_modules() if name.startswith("layers.") and isinstance(m, nn.Linear)}


def quantize_w8a8(model: nn.Module, thresholds: dict[str, float]) -> None:
    """Swap every decoder projection for a W8A8Linear with its input's calibrated threshold."""
    linears = decoder_linears(model)
    missing = sorted(set(linears) - set(thresholds))
    unknown = sorted(set(thresholds) - set(linears))
    if missing or unknown:
        raise ValueError(f"the calibration does not fit this model: {len(missing)} of its layers have no threshold "
                         f"({', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}) and {len(unknown)} thresholds "
                         f"name no layer of it ({', '.join(unknown[:3])}{' …' if len(unknown) > 3 else ''}); "
                         "calibrate this model with `inferno calibrate`")
    for name, linear in linears.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, W8A8Linear(linear.weight, linear.bias, thresholds[name]))
