"""Activation calibration files: per decoder projection, its SmoothQuant factors (one per input channel), written
by `inferno calibrate` beside the model and read when `quantization="w8a8"`. JSON:

    {"format": "inferno-activation-calibration", "version": 2, "smoothing": null, "num_tokens": 512,
     "model": {"architecture": "llama", "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536},
     "layers": {"layers.0.self_attn.qkv_proj": {"smoothing": [0.8, ...]}, ...}}

"smoothing": the migration strength used for every layer, or null: each projection type's own (SMOOTHING in
layers/quantization/activation_calibration.py). Version 1 files held static activation thresholds, which per-token
scales replaced: they are refused with a request to calibrate again.
"""
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from inferno.config import ModelConfig

FORMAT = "inferno-activation-calibration"
VERSION = 2


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a calibration must agree with: the layers it names exist with these sizes."""
    architecture: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int

    @classmethod
    def of(cls, config: ModelConfig) -> "ModelShape":
        return cls(config.architecture, config.num_hidden_layers, config.hidden_size, config.intermediate_size)


def default_calibration_path(model_path: str) -> Path:
    """Beside the model: `<folder>/activation_calibration.json`, or `<file>.calibration.json` for a GGUF file."""
    path = Path(model_path)
    return path / "activation_calibration.json" if path.is_dir() else path.with_name(path.name + ".calibration.json")


def write_calibration(path: Path, config: ModelConfig, smoothing: float | None, num_tokens: int,
                      layers: dict[str, torch.Tensor]) -> None:
    """`layers`: per layer name, its SmoothQuant factors (ActivationRecorder.smoothing)."""
    document = {"format": FORMAT, "version": VERSION, "smoothing": smoothing, "num_tokens": num_tokens,
                "model": asdict(ModelShape.of(config)),
                "layers": {name: {"smoothing": [float(f"{s:.7g}") for s in factors.tolist()]}
                           for name, factors in sorted(layers.items())}}
    Path(path).write_text(json.dumps(document) + "\n")


def read_calibration(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Layer name -> its smoothing factors, checked against the model's shape."""
    path = Path(path)
    hint = "write one with `inferno calibrate MODEL --output FILE`"
    if not path.is_file():
        raise ValueError(f"calibration file {str(path)!r} does not exist; {hint}")
    try:
        document = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"calibration file {str(path)!r} is not valid JSON ({e}); {hint}") from None
    if isinstance(document, dict) and document.get("format") == FORMAT and document.get("version") == 1:
        raise ValueError(f"calibration file {str(path)!r} is version 1 (static activation thresholds), which "
                         f"inferno no longer reads: activations are scaled per token now; {hint}")
    if not isinstance(document, dict) or document.get("format") != FORMAT or document.get("version") != VERSION:
        raise ValueError(f"{str(path)!r} is not an inferno activation calibration file (format {FORMAT!r}, "
                         f"version {VERSION}); {hint}")
    shape = asdict(ModelShape.of(config))
    if document.get("model") != shape:
        raise ValueError(f"calibration file {str(path)!r} was made for another model ({document.get('model')}, "
                         f"this one is {shape}); {hint}")
    layers = {}
    for name, entry in document.get("layers", {}).items():
        smoothing = torch.tensor(entry.get("smoothing") or [] if isinstance(entry, dict) else [], dtype=torch.float32)
        if smoothing.dim() != 1 or smoothing.numel() == 0 or not torch.all(torch.isfinite(smoothing) & (smoothing > 0)):
            raise ValueError(f"calibration file {str(path)!r}: layer {name!r} needs a list of positive smoothing "
                             "factors, one per input feature")
        layers[name] = smoothing
    return layers
