"""W8A8: int8 weights and int8 activations for prefill-sized batches, with calibrated SmoothQuant factors.

Activations are quantized per token (row): x ≈ codes · absmax / 127, codes unsigned bytes with zero point 128;
weights per output channel (absmax). The rows are scaled, rotated and quantized in one native pass
(`w8a8_quantize_rows`, kernels/w8a8_activations.cpp; PyTorch ops without a compiler). The product runs in integers
in oneDNN's u8 x s8 GEMM (`torch.ops.onednn.qlinear_pointwise`, float32 out, weight scales applied there), and one
more pass (`w8a8_scale_rows`) multiplies the row scales in, adds the bias and rounds to the input's dtype.
`torch._int_mm` is a plain loop on CPU.

SmoothQuant (activation_calibration.py): x / s and W · s compute the same product, with the activations' outlier
channels scaled down. The 1 / s of a projection is folded into the operation before it (`quantize_w8a8`): the RMSNorm
weight in front of QKV and gate/up, the up rows of gate/up in front of down (silu(g) · u / s = (silu(g) · u) / s), so
no multiply runs; elsewhere (experts behind a shared router) the layer multiplies its input. down_proj's input,
whose rare tokens carry massive activations, is also rotated by a Hadamard matrix per block of ROTATION_BLOCK
channels (QuaRot's remedy; the weight columns are rotated alike, H orthonormal): one outlier spreads over the block.
Per layer type on SmolLM2-135M (KL vs float32, only that type quantized, benchmarks/quality.py's texts): down_proj
0.0073 with smoothing 0.5 and 0.0009 rotated; qkv 0.0041 -> 0.0022 with smoothing 0.65 instead of 0.5.

Without VNNI the GEMM multiplies with `vpmaddubsw`, which adds two u8 x s8 products in a saturating int16:
255 · 127 · 2 overflows it. There the weights get 7-bit codes (±63; 255 · 63 · 2 < 2^15, exact). With AVX-512
VNNI or AVX-VNNI the products accumulate in int32 and the weights keep ±127.

Decode-sized batches (below the layer's `gemm_from_rows`, thresholds.py) stay weight-only: the same int8 codes
through `torch._weight_int8pack_mm` with bfloat16 activations (per-row overhead of the quantized GEMM dominates
there).
"""
import torch
import torch.nn.functional as F
from torch import nn

from inferno.cpu_features import cpu_flags
from inferno.kernels import w8a8_activations
from inferno.layers.quantization.linear import QuantizedLinear
from inferno.layers.quantization.q8 import Q8Linear

ACTIVATION_LEVELS = 127
ACTIVATION_ZERO_POINT = 128
WEIGHT_LEVELS = 127 if {"avx512_vnni", "avx_vnni"} & cpu_flags() else 63
ROTATION_BLOCK = 64  # down_proj's input channels rotated together


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal n x n Hadamard matrix (Sylvester's construction; n a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)])
    return h / n ** 0.5


def rotation_block(in_features: int) -> int:
    """The largest power of two up to ROTATION_BLOCK that divides `in_features`."""
    return min(in_features & -in_features, ROTATION_BLOCK)


def rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the block-diagonal matrix of h's along K."""
    return torch.mm(x.reshape(-1, h.shape[0]), h).view(x.shape)


class W8A8Linear(QuantizedLinear):
    """`weight` acts on the input as it arrives (smoothing folded in), times `input_scales` if given; rotated: its
    input is rotated per block of rotation_block(in_features) channels first. Its `gemm` is the int8 x int8 product,
    its `matmul` the weight-only kernel; both add the bias in float32, before the output is rounded to the input's
    dtype (`output_bias`: the forward's own `bias`, added after the rounding, stays None)."""
    weight_format = "w8a8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, input_scales: torch.Tensor | None = None,
                 rotated: bool = False):
        super().__init__(*weight.shape, None, native=True)  # the weight-only kernel is PyTorch's own
        w = weight.detach().float()
        self.register_buffer("input_scales", None if input_scales is None else input_scales.float())
        self.register_buffer("rotation", hadamard(rotation_block(self.in_features)) if rotated else None)
        if rotated:
            w = rotate(w, self.rotation)
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / WEIGHT_LEVELS
        self.register_buffer("weight", torch.round(w / scales.unsqueeze(1)).clamp(-WEIGHT_LEVELS, WEIGHT_LEVELS)
                             .to(torch.int8).contiguous())
        self.register_buffer("scales", scales)
        self.register_buffer("scales_bf16", scales.bfloat16())  # _weight_int8pack_mm is fast with bfloat16 only
        self.register_buffer("output_bias", None if bias is None else bias.detach().float())
        self.register_buffer("weight_zero_points", torch.zeros(self.out_features, dtype=torch.long))
        self.onednn = torch.backends.mkldnn.is_available()
        self.kernels = w8a8_activations()
        self.packed = torch.ops.onednn.qlinear_prepack(self.weight, None) if self.onednn else None

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] as the weight codes expect it: float32, scaled and rotated where this layer does that."""
        x = x.float()
        if self.input_scales is not None:
            x = x * self.input_scales
        return x if self.rotation is None else rotate(x, self.rotation)

    @staticmethod
    def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[M, K] float32 -> uint8 codes (zero point 128) and the row scales [M, 1], absmax / 127 per row."""
        scales = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(ACTIVATION_LEVELS)
        return x.div(scales).round_().add_(ACTIVATION_ZERO_POINT).to(torch.uint8), scales

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] as it arrives -> the codes and row scales of its prepared rows (one native pass where built)."""
        if self.kernels is None:
            return self.quantize_rows(self.prepare_input(x))
        block = 0 if self.rotation is None else self.rotation.shape[0]
        return self.kernels.w8a8_quantize_rows(x if x.dtype == torch.bfloat16 else x.float(), self.input_scales, block)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """The integer product of the quantized rows of x (as it arrives) and the weight codes, scaled, plus the
        bias: [M, N] in x's dtype (float32 or bfloat16)."""
        codes, row_scales = self.quantize_input(x.contiguous())
        if self.onednn:  # the row scales are applied after: the GEMM sees a scale of 1
            y = torch.ops.onednn.qlinear_pointwise(
                codes, 1.0, ACTIVATION_ZERO_POINT, self.packed, self.scales, self.weight_zero_points,
                None, 1.0, 0, torch.float32, "none", [], "")
        else:
            y = F.linear(codes.float() - ACTIVATION_ZERO_POINT, self.dequantize())
        traced = torch.compiler.is_compiling()  # then inductor fuses the PyTorch ops below
        if self.kernels is not None and x.dtype in (torch.float32, torch.bfloat16) and not traced:
            out = y if x.dtype == torch.float32 else torch.empty_like(y, dtype=x.dtype)
            self.kernels.w8a8_scale_rows(y, row_scales, self.output_bias, out)
            return out
        y = y.mul_(row_scales)
        return (y if self.output_bias is None else y.add_(self.output_bias)).to(x.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The weight-only product (bfloat16 activations), plus the bias: [M, N] float32."""
        y = torch._weight_int8pack_mm(self.prepare_input(x).bfloat16(), self.weight, self.scales_bf16).float()
        return y if self.output_bias is None else y.add_(self.output_bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`: the codes times their scales, acting on the prepared input (`prepare_input`)."""
        return (self.weight.float() * self.scales.unsqueeze(1)).to(dtype)


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The projections of the decoder layers (fused QKV and gate/up, O, down, experts), by name in the model."""
    return {name: m for name, m in model.named_modules() if name.startswith("layers.") and isinstance(m, nn.Linear)}


def norm_before(model: nn.Module, name: str) -> nn.Module | None:
    """The RMSNorm whose output is this projection's input and nothing else's, if any: the input norm of a layer's
    QKV, the feed-forward norm of its dense MLP's gate/up."""
    parts = name.split(".")
    layer, projection = model.get_submodule(".".join(parts[:2])), ".".join(parts[2:])
    if projection == "self_attn.qkv_proj":
        return layer.input_layernorm
    if projection == "mlp.gate_up_proj":
        return layer.pre_feedforward_layernorm or layer.post_attention_layernorm
    return None


def check_calibration(linears: dict[str, nn.Linear], smoothing: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(linears) - set(smoothing))
    unknown = sorted(set(smoothing) - set(linears))
    if missing or unknown:
        raise ValueError(f"the calibration does not fit this model: {len(missing)} of its layers have no smoothing "
                         f"factors ({', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}) and {len(unknown)} "
                         f"entries name no layer of it ({', '.join(unknown[:3])}{' …' if len(unknown) > 3 else ''}); "
                         "calibrate this model with `inferno calibrate`")
    for name, linear in linears.items():
        if smoothing[name].shape != (linear.in_features,):
            raise ValueError(f"the calibration does not fit this model: layer {name!r} has {linear.in_features} "
                             f"inputs but {smoothing[name].numel()} smoothing factors")


def quantize_w8a8(model: nn.Module, smoothing: dict[str, torch.Tensor]) -> None:
    """Swap every decoder projection for a W8A8Linear with its calibrated SmoothQuant factors, folding 1 / s into
    the operation before it where there is one of its own (see the module docstring); down_proj's input rotated.
    The LM head becomes symmetric int8 groups with int8 activations (Q8Linear, as in the int8 and int4 models): in
    float32 it is a tenth of a 512-token prefill of Qwen2.5-0.5B, reading 0.5 GB for one row of logits."""
    linears = decoder_linears(model)
    check_calibration(linears, smoothing)
    weights = {name: linear.weight.detach().float() * smoothing[name] for name, linear in linears.items()}
    input_scales = {}
    for name, s in smoothing.items():
        norm = norm_before(model, name)
        up_rows = name.removesuffix("down_proj") + "gate_up_proj"
        if norm is not None:
            norm.weight.data /= s.to(norm.weight.dtype)
        elif name.endswith(".down_proj") and up_rows in weights:
            weights[up_rows][weights[up_rows].shape[0] // 2:] /= s.unsqueeze(1)
        elif not torch.all(s == 1):
            input_scales[name] = 1 / s
    for name, linear in linears.items():
        parent, _, attr = name.rpartition(".")
        layer = W8A8Linear(weights[name], linear.bias, input_scales.get(name), rotated=name.endswith(".down_proj"))
        setattr(model.get_submodule(parent), attr, layer)
    if getattr(model, "lm_head", None) is not None:  # int8 too, as the int8 / int4 models have it
        model.lm_head = Q8Linear.from_float(model.lm_head.weight)
