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


class ActivationRecorder:
    """Forward pre-hooks on `layers` recording their inputs: each layer's absmax, then, after `start_histograms`,
    histograms of |x| over [0, absmax] (run the same inputs twice); `thresholds` turns them into clipping
    thresholds."""

    def __init__(self, layers: dict[str, nn.Module]):
        self.absmax = {name: 0.0 for name in layers}
        self.hists: dict[str, torch.Tensor] = {}
        self.handles = [layer.register_forward_pre_hook(self._hook(name)) for name, layer in layers.items()]

    def _hook(self, name: str):
        def record(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().float().abs()
            if name not in self.hists:
                self.absmax[name] = max(self.absmax[name], x.max().item())
            else:
                self.hists[name] += torch.histc(x, NUM_BINS, 0.0, self.absmax[name])
        return record

    def start_histograms(self) -> None:
        for name, absmax in self.absmax.items():
            if absmax == 0.0:
                raise ValueError(f"layer {name!r} saw no input (or only zeros) during calibration")
            self.hists[name] = torch.zeros(NUM_BINS, dtype=torch.float64)

    def thresholds(self, method: str) -> dict[str, float]:
        if method == "absmax":
            return dict(self.absmax)
        return {name: entropy_threshold(self.hists[name].numpy(), self.absmax[name]) for name in self.absmax}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
