"""SmoothQuant factors for int8 activations, calibrated on sample text.

Forward pre-hooks record each decoder projection's input channels' absmax; a projection's factors are
s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha), with the migration strength alpha of its type (SMOOTHING). Measured
on SmolLM2-135M (benchmarks/quality.py's texts, KL vs float32 with only that type in W8A8, per-token scales): QKV
0.0193 / 0.0041 / 0.0022 at alpha 0 / 0.5 / 0.65, O 0.0005 / 0.0006 at 0 / 0.5, gate/up 0.0099 / 0.0025 / 0.0021,
down (rotated, see w8a8.py) 0.0021 / 0.0009 at 0 / 0.5.
"""
import torch
from torch import nn

# SmoothQuant's migration strength per projection type (by the end of its name); 0: no smoothing
SMOOTHING = {"qkv_proj": 0.65, "o_proj": 0.0, "gate_up_proj": 0.65, "down_proj": 0.5}


def smoothing_factors(channel_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors s = max|x_j|^alpha / max|W_:,j|^(1 - alpha): x / s and W * s
    compute the same product, with the activations' outlier channels scaled down and the weights' columns up by
    as much. alpha 0: no smoothing."""
    if alpha == 0:
        return torch.ones_like(channel_absmax)
    weight_absmax = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
    return (channel_absmax.clamp(min=1e-5) ** alpha / weight_absmax ** (1 - alpha)).clamp(min=1e-5)


def projection_alpha(name: str, smoothing: float | None) -> float:
    """The migration strength for the projection `name`: `smoothing` for all, or None: its type's (SMOOTHING)."""
    if smoothing is not None:
        return smoothing
    return next((alpha for kind, alpha in SMOOTHING.items() if name.endswith(kind)), 0.5)


class ActivationRecorder:
    """Forward pre-hooks on `layers` recording each input channel's absmax; `smoothing` turns them into factors."""

    def __init__(self, layers: dict[str, nn.Module]):
        self.layers = layers
        self.channel_absmax = {name: torch.zeros(layer.in_features) for name, layer in layers.items()}
        self.handles = [layer.register_forward_pre_hook(self._hook(name)) for name, layer in layers.items()]

    def _hook(self, name: str):
        def record(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().float().abs().reshape(-1, module.in_features)
            torch.maximum(self.channel_absmax[name], x.amax(dim=0), out=self.channel_absmax[name])
        return record

    def smoothing(self, smoothing: float | None) -> dict[str, torch.Tensor]:
        """Per layer, its SmoothQuant factors (alpha: `smoothing`, or None: by projection type)."""
        factors = {}
        for name, channel_absmax in self.channel_absmax.items():
            if channel_absmax.max() == 0.0:
                raise ValueError(f"layer {name!r} saw no input (or only zeros) during calibration")
            alpha = projection_alpha(name, smoothing)
            factors[name] = smoothing_factors(channel_absmax, self.layers[name].weight, alpha)
        return factors

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
