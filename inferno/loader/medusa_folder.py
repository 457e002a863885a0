"""The folder of Medusa heads: config.json and the heads' weights, in the reference layout (FasterDecoding/Medusa:
`medusa_lm_head.safetensors` or `.pt`, keys `{head}.{layer}.linear.weight|bias` and `{head}.{num_layers}.weight`
for the head's LM head) or vLLM's (`model.safetensors`, keys `blocks.{head}.layers.{layer}.weight|bias` and
`lm_heads.{head}.weight`, one shared `lm_heads.0.weight` with `original_lm_head`).

A folder whose heads end in the base model's own LM head (inferno's heads by default: the LM head is the biggest
part of a head and the base's is a good one) says so with `"base_lm_head": true` and holds no LM head weights."""
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from inferno.loader.head_folder import read_head_config, read_head_weights

REFERENCE_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
VLLM_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


@dataclass(slots=True)
class MedusaFolder:
    num_heads: int
    num_layers: int
    # per head: its blocks' (weight, bias or None); and its LM head's weight, None: the base model's
    blocks: list[list[tuple[torch.Tensor, torch.Tensor | None]]]
    lm_heads: list[torch.Tensor] | None
    base_model: str | None = None


def read_medusa_folder(folder: str | Path) -> MedusaFolder:
    folder = Path(folder)
    config = read_head_config(folder, "Medusa heads")
    num_heads = config.get("medusa_num_heads", config.get("num_heads"))
    num_layers = config.get("medusa_num_layers", config.get("num_hidden_layers", 1))
    if not isinstance(num_heads, int) or num_heads < 1 or not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"{folder / 'config.json'} must give medusa_num_heads (>= 1) and medusa_num_layers (>= 0), "
                         f"got {num_heads!r} and {num_layers!r}")
    tensors = read_head_weights(folder, REFERENCE_WEIGHTS + VLLM_WEIGHTS, "Medusa heads")
    tensors = {name.removeprefix("medusa_heads."): t for name, t in tensors.items()}
    if any(re.fullmatch(r"\d+\.\d+\.(linear\.)?(weight|bias)", name) for name in tensors):
        blocks, lm_heads = _reference_layout(tensors, num_heads, num_layers)
    else:
        blocks, lm_heads = _vllm_layout(tensors, num_heads, num_layers, bool(config.get("original_lm_head")))
    if lm_heads is None and not config.get("base_lm_head"):
        raise ValueError(f"{folder} has no LM head weights for its heads; a folder whose heads use the base model's "
                         f"LM head says so in config.json with \"base_lm_head\": true")
    return MedusaFolder(num_heads, num_layers, blocks, lm_heads, config.get("base_model_name_or_path"))


def _take(tensors: dict[str, torch.Tensor], name: str, required: bool = True) -> torch.Tensor | None:
    if name not in tensors and required:
        raise ValueError(f"the Medusa weights have no tensor {name!r}")
    return tensors.get(name)


def _reference_layout(tensors, num_heads: int, num_layers: int):
    blocks = [[(_take(tensors, f"{h}.{i}.linear.weight"), _take(tensors, f"{h}.{i}.linear.bias", False))
               for i in range(num_layers)] for h in range(num_heads)]
    lm_heads = [_take(tensors, f"{h}.{num_layers}.weight", False) for h in range(num_heads)]
    return blocks, _all_or_none(lm_heads)


def _vllm_layout(tensors, num_heads: int, num_layers: int, shared_lm_head: bool):
    blocks = [[(_take(tensors, f"blocks.{h}.layers.{i}.weight"), _take(tensors, f"blocks.{h}.layers.{i}.bias", False))
               for i in range(num_layers)] for h in range(num_heads)]
    if shared_lm_head:
        shared = _take(tensors, "lm_heads.0.weight", False)
        shared = shared if shared is not None else _take(tensors, "lm_head.weight", False)
        return blocks, None if shared is None else [shared] * num_heads
    return blocks, _all_or_none([_take(tensors, f"lm_heads.{h}.weight", False) for h in range(num_heads)])


def _all_or_none(lm_heads: list[torch.Tensor | None]) -> list[torch.Tensor] | None:
    present = [w is not None for w in lm_heads]
    if any(present) and not all(present):
        raise ValueError(f"the Medusa weights have LM heads for heads {[i for i, p in enumerate(present) if p]} only")
    return lm_heads if all(present) else None


def write_medusa_folder(folder: str | Path, heads: MedusaFolder) -> Path:
    """The reference layout (medusa_lm_head.safetensors), `base_lm_head` set when the heads have no LM heads."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for h, blocks in enumerate(heads.blocks):
        for i, (weight, bias) in enumerate(blocks):
            tensors[f"{h}.{i}.linear.weight"] = weight
            if bias is not None:
                tensors[f"{h}.{i}.linear.bias"] = bias
        if heads.lm_heads is not None:
            tensors[f"{h}.{heads.num_layers}.weight"] = heads.lm_heads[h]
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()},
              folder / "medusa_lm_head.safetensors")
    config = {"architectures": ["MedusaModel"], "medusa_num_heads": heads.num_heads,
              "medusa_num_layers": heads.num_layers, "base_model_name_or_path": heads.base_model,
              "base_lm_head": heads.lm_heads is None}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
