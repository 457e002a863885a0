"""W8A8: int8 weights and int8 activations with calibrated static thresholds, for prefill-sized batches.

Per layer, calibrated on sample text (activation_calibration.py): SmoothQuant factors s (one per input channel)
and one threshold T of the smoothed input x / s. Weights: W · s (columns), symmetric per output channel (absmax).
Activations: a token (row) whose smoothed values stay within T is quantized with the static scale T / 127,
x / s ≈ round(x / s · 127 / T) · T / 127; a row that goes beyond T gets its own absmax / 127 instead of being
clipped. Clipping at T, as TensorRT does, wrecked SmolLM2: its rare tokens with massive activations (up to ~40
against an entropy threshold of ~2.5 at down_proj's input) carry the attention sink. Top-1 agreement with float32
on benchmarks/quality.py's texts (smoothing 0.5, entropy thresholds): 22 % clipping every row, 66 % giving rows
beyond 4T their own scale, 94 % giving every row beyond T its own scale (this layer). Codes are unsigned bytes with
zero point 128; the GEMM runs with scale 1 and the row scales multiply its float32 output. The product runs in
integers in oneDNN's u8 x s8 GEMM (`torch.ops.onednn.qlinear_pointwise`, float32 out, per-channel weight scales
applied there): 6 ms against 15 ms for the float32 GEMM and 110 ms for bfloat16 on a 512 x 576 x 1536 product,
one thread, AVX2 Zen 3; `torch._int_mm` is a plain loop on CPU (411 ms).

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
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, threshold: float,
                 smoothing: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        smoothing = torch.ones(self.in_features) if smoothing is None else smoothing.float()
        w = weight.detach().float() * smoothing
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / WEIGHT_LEVELS
        self.register_buffer("weight", torch.round(w / scales.unsqueeze(1)).clamp(-WEIGHT_LEVELS, WEIGHT_LEVELS)
                             .to(torch.int8).contiguous())
        self.register_buffer("scales", scales)
        self.register_buffer("scales_bf16", scales.bfloat16())  # _weight_int8pack_mm is fast with bfloat16 only
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.register_buffer("weight_zero_points", torch.zeros(self.out_features, dtype=torch.long))
        self.threshold = threshold
        self.input_scale = threshold / ACTIVATION_LEVELS
        self.register_buffer("inverse_smoothing", 1 / smoothing)
        self.native = torch.backends.mkldnn.is_available()
        self.packed = torch.ops.onednn.qlinear_prepack(self.weight, None) if self.native else None

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[M, K] float -> uint8 codes of x / smoothing (zero point 128) and the row scales [M, 1]: threshold / 127,
        or a row's own absmax / 127 when the row goes beyond the threshold (see the module docstring)."""
        smoothed = x.float() * self.inverse_smoothing
        scales = torch.clamp(smoothed.abs().amax(dim=1, keepdim=True), min=self.threshold) / ACTIVATION_LEVELS
        codes = torch.round(smoothed / scales).clamp_(-ACTIVATION_LEVELS, ACTIVATION_LEVELS)
        return (codes + ACTIVATION_ZERO_POINT).to(torch.uint8), scales

    def int8_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The integer product of quantized x and the weight codes, scaled to float32 [M, N] (plus bias)."""
        codes, row_scales = self.quantize_input(x)
        if self.native:  # the row scales are applied after: the GEMM sees a scale of 1
            y = torch.ops.onednn.qlinear_pointwise(
                codes, 1.0, ACTIVATION_ZERO_POINT, self.packed, self.scales, self.weight_zero_points,
                None, 1.0, 0, torch.float32, "none", [], "")
        else:
            y = F.linear(codes.float() - ACTIVATION_ZERO_POINT, self.weight.float() * self.scales.unsqueeze(1))
        y = y * row_scales
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] >= W8A8_FROM_ROWS:
            y = self.int8_matmul(x2)
        else:
            smoothed = (x2.float() * self.inverse_smoothing).bfloat16()
            y = torch._weight_int8pack_mm(smoothed, self.weight, self.scales_bf16).float()
            y = y if self.bias is None else y + self.bias
        return y.view(*shape[:-1], self.out_features).to(x.dtype)


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The projections of the decoder layers (fused QKV and gate/up, O, down, experts), by name in the model."""
    return {name: m for name, m in model.named_modules() if name.startswith("layers.") and isinstance(m, nn.Linear)}


def quantize_w8a8(model: nn.Module, calibration: dict[str, tuple[float, torch.Tensor]]) -> None:
    """Swap every decoder projection for a W8A8Linear with its calibrated (threshold, smoothing factors)."""
    linears = decoder_linears(model)
    missing = sorted(set(linears) - set(calibration))
    unknown = sorted(set(calibration) - set(linears))
    if missing or unknown:
        raise ValueError(f"the calibration does not fit this model: {len(missing)} of its layers have no threshold "
                         f"({', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}) and {len(unknown)} thresholds "
                         f"name no layer of it ({', '.join(unknown[:3])}{' …' if len(unknown) > 3 else ''}); "
                         "calibrate this model with `inferno calibrate`")
    for name, linear in linears.items():
        threshold, smoothing = calibration[name]
        if smoothing.shape != (linear.in_features,):
            raise ValueError(f"the calibration does not fit this model: layer {name!r} has {linear.in_features} "
                             f"inputs but {smoothing.numel()} smoothing factors")
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, W8A8Linear(linear.weight, linear.bias, threshold, smoothing))
