"""Activation calibration files: per decoder projection, its SmoothQuant factors (one per input channel) and the
clipping threshold of its smoothed int8 input (and that input's absmax), written by `inferno calibrate` beside the
model and read when `quantization="w8a8"`. JSON:

    {"format": "inferno-activation-calibration", "version": 1, "method": "entropy", "smoothing": 0.5,
     "num_tokens": 512,
     "model": {"architecture": "llama", "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536},
     "layers": {"layers.0.self_attn.qkv_proj": {"threshold": 3.1, "absmax": 9.7, "smoothing": [0.8, ...]}, ...}}
"""
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from inferno.config import ModelConfig

FORMAT = "inferno-activation-calibration"
VERSION = 1


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


def write_calibration(path: Path, config: ModelConfig, method: str, alpha: float, num_tokens: int,
                      layers: dict[str, dict]) -> None:
    """`layers`: per layer name, {"threshold", "absmax", "smoothing"} (ActivationRecorder.calibration)."""
    document = {"format": FORMAT, "version": VERSION, "method": method, "smoothing": alpha, "num_tokens": num_tokens,
                "model": asdict(ModelShape.of(config)),
                "layers": {name: {"threshold": entry["threshold"], "absmax": entry["absmax"],
                                  "smoothing": [float(f"{s:.7g}") for s in entry["smoothing"]]}
                           for name, entry in sorted(layers.items())}}
    Path(path).write_text(json.dumps(document) + "\n")


def read_calibration(path: Path, config: ModelConfig) -> dict[str, tuple[float, torch.Tensor]]:
    """Layer name -> (threshold, smoothing factors), checked against the model's shape."""
    path = Path(path)
    hint = "write one with `inferno calibrate MODEL --output FILE`"
    if not path.is_file():
        raise ValueError(f"calibration file {str(path)!r} does not exist; {hint}")
    try:
        document = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"calibration file {str(path)!r} is not valid JSON ({e}); {hint}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT or document.get("version") != VERSION:
        raise ValueError(f"{str(path)!r} is not an inferno activation calibration file (format {FORMAT!r}, "
                         f"version {VERSION}); {hint}")
    shape = asdict(ModelShape.of(config))
    if document.get("model") != shape:
        raise ValueError(f"calibration file {str(path)!r} was made for another model ({document.get('model')}, "
                         f"this one is {shape}); {hint}")
    layers = {}
    for name, entry in document.get("layers", {}).items():
        threshold = entry.get("threshold") if isinstance(entry, dict) else None
        if not isinstance(threshold, (int, float)) or not math.isfinite(threshold) or threshold <= 0:
            raise ValueError(f"calibration file {str(path)!r}: layer {name!r} has threshold {threshold!r}, "
                             "expected a positive number")
        smoothing = torch.tensor(entry.get("smoothing") or [], dtype=torch.float32)
        if smoothing.dim() != 1 or not torch.all(torch.isfinite(smoothing) & (smoothing > 0)):
            raise ValueError(f"calibration file {str(path)!r}: layer {name!r} needs a list of positive smoothing "
                             "factors, one per input feature")
        layers[name] = (float(threshold), smoothing)
    return layers
