"""Activation calibration files: per decoder projection, the clipping threshold of its int8 input (and the absmax
seen), written by `inferno calibrate` beside the model and read when `quantization="w8a8"`. JSON:

    {"format": "inferno-activation-calibration", "version": 1, "method": "entropy", "num_tokens": 512,
     "model": {"architecture": "llama", "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536},
     "layers": {"layers.0.self_attn.qkv_proj": {"threshold": 3.1, "absmax": 9.7}, ...}}
"""
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

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


def write_calibration(path: Path, config: ModelConfig, method: str, num_tokens: int,
                      thresholds: dict[str, float], absmax: dict[str, float]) -> None:
    layers = {name: {"threshold": thresholds[name], "absmax": absmax[name]} for name in sorted(thresholds)}
    document = {"format": FORMAT, "version": VERSION, "method": method, "num_tokens": num_tokens,
                "model": asdict(ModelShape.of(config)), "layers": layers}
    Path(path).write_text(json.dumps(document, indent=1) + "\n")


def read_calibration(path: Path, config: ModelConfig) -> dict[str, float]:
    """Layer name -> threshold, checked against the model's shape."""
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
    thresholds = {}
    for name, entry in document.get("layers", {}).items():
        threshold = entry.get("threshold") if isinstance(entry, dict) else None
        if not isinstance(threshold, (int, float)) or not math.isfinite(threshold) or threshold <= 0:
            raise ValueError(f"calibration file {str(path)!r}: layer {name!r} has threshold {threshold!r}, "
                             "expected a positive number")
        thresholds[name] = float(threshold)
    return thresholds
