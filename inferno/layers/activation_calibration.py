"""Clipping thresholds for int8 activations, calibrated on sample text (TensorRT's entropy calibration).

The absolute values a layer's input takes are histogrammed over [0, absmax] in NUM_BINS bins. Quantizing to int8
with threshold T clips everything above T and rounds the rest onto QUANTIZED_BINS levels; absmax (T = absmax) wastes
the levels on a few outliers. For each candidate T (the upper edge of bin i, i = QUANTIZED_BINS .. NUM_BINS):
- P, the float distribution as it would be clipped: the first i bins, the mass beyond T added to the last one;
- Q, what int8 keeps of it: the first i bins merged into QUANTIZED_BINS runs of bins, each run's mass spread evenly
  over its non-empty bins;
and T minimises KL(P || Q). Where P has mass and Q none (the clipped tail lands in an empty last bin), Q gets
SMOOTHING before both are normalised, as TensorRT smooths it: clipping isolated outliers costs a bounded penalty
instead of an infinite one.
"""
import math

import numpy as np
import torch
from torch import nn

NUM_BINS = 2048
QUANTIZED_BINS = 128  # |x| levels of a symmetric int8 code, 0..127
SMOOTHING = 1e-4  # the share of Q given to a bin where P has mass and Q none


def entropy_threshold(hist: np.ndarray, absmax: float) -> float:
    """The threshold in (0, absmax] minimising KL(P || Q) for a histogram of |x| over [0, absmax]."""
    hist = np.asarray(hist, dtype=np.float64)
    bins = len(hist)
    if bins <= QUANTIZED_BINS or hist.sum() == 0:
        return absmax
    best_kl, best_bins = math.inf, bins
    for i in range(QUANTIZED_BINS, bins + 1):
        kl = clipping_divergence(hist, i)
        if kl < best_kl:
            best_kl, best_bins = kl, i
    return absmax * best_bins / bins


def clipping_divergence(hist: np.ndarray, i: int) -> float:
    """KL(P || Q) of clipping the histogram after its first i bins (see the module docstring)."""
    p = hist[:i].copy()
    p[-1] += hist[i:].sum()
    edges = (np.arange(QUANTIZED_BINS + 1) * i) // QUANTIZED_BINS  # run j covers bins edges[j]..edges[j + 1] - 1
    run = np.repeat(np.arange(QUANTIZED_BINS), np.diff(edges))
    nonempty = hist[:i] > 0
    run_mass = np.bincount(run, weights=hist[:i], minlength=QUANTIZED_BINS)
    run_count = np.bincount(run, weights=nonempty, minlength=QUANTIZED_BINS)
    q = np.where(nonempty, run_mass[run] / np.maximum(run_count[run], 1), 0.0)
    q = q / q.sum()
    q = np.where((p > 0) & (q == 0), SMOOTHING, q)
    p, q = p / p.sum(), q / q.sum()
    present = p > 0
    return float(np.sum(p[present] * np.log(p[present] / q[present])))


def smoothing_factors(channel_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors s = max|x_j|^alpha / max|W_:,j|^(1 - alpha): x / s and W * s
    compute the same product, with the activations' outlier channels scaled down and the weights' columns up by
    as much, so that one per-tensor threshold fits the activations. alpha 0: no smoothing."""
    if alpha == 0:
        return torch.ones_like(channel_absmax)
    weight_absmax = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
    return (channel_absmax.clamp(min=1e-5) ** alpha / weight_absmax ** (1 - alpha)).clamp(min=1e-5)


class ActivationRecorder:
    """Forward pre-hooks on `layers` recording their inputs: each input channel's absmax, then, after
    `start_histograms(alpha)` has fixed the layers' smoothing factors (`smoothing_factors`), histograms of the
    smoothed |x / s| over [0, their absmax] (run the same inputs twice); `calibration` turns them into thresholds."""

    def __init__(self, layers: dict[str, nn.Module]):
        self.layers = layers
        self.channel_absmax = {name: torch.zeros(layer.in_features) for name, layer in layers.items()}
        self.smoothing: dict[str, torch.Tensor] = {}
        self.absmax: dict[str, float] = {}
        self.hists: dict[str, torch.Tensor] = {}
        self.handles = [layer.register_forward_pre_hook(self._hook(name)) for name, layer in layers.items()]

    def _hook(self, name: str):
        def record(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().float().abs().reshape(-1, module.in_features)
            if name not in self.hists:
                torch.maximum(self.channel_absmax[name], x.amax(dim=0), out=self.channel_absmax[name])
            else:
                self.hists[name] += torch.histc(x / self.smoothing[name], NUM_BINS, 0.0, self.absmax[name])
        return record

    def start_histograms(self, alpha: float) -> None:
        for name, channel_absmax in self.channel_absmax.items():
            if channel_absmax.max() == 0.0:
                raise ValueError(f"layer {name!r} saw no input (or only zeros) during calibration")
            self.smoothing[name] = smoothing_factors(channel_absmax, self.layers[name].weight, alpha)
            self.absmax[name] = (channel_absmax / self.smoothing[name]).max().item()
            self.hists[name] = torch.zeros(NUM_BINS, dtype=torch.float64)

    def calibration(self, method: str) -> dict[str, dict]:
        """Per layer: the clipping threshold of its smoothed input ("entropy" or "absmax"), that input's absmax and
        the smoothing factors (a list per input channel)."""
        return {name: {"threshold": absmax if method == "absmax" else entropy_threshold(self.hists[name].numpy(),
                                                                                      absmax),
                       "absmax": absmax, "smoothing": self.smoothing[name].tolist()}
                for name, absmax in self.absmax.items()}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
