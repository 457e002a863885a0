"""What every folder of speculative heads (Medusa, EAGLE) holds: a config.json and one weights file."""
import json
from pathlib import Path

import torch


def read_head_config(folder: Path, kind: str) -> dict:
    """The folder's config.json; `kind` names the heads in the error ("Medusa heads", "an EAGLE head")."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} is not a folder of {kind}: it has no config.json")
    return json.loads(config_path.read_text())


def read_head_weights(folder: Path, file_names: tuple[str, ...], kind: str,
                      sharded: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of the first of `file_names` the folder has (else, if `sharded`, of all its .safetensors)."""
    from safetensors.torch import load_file
    for name in file_names:
        path = folder / name
        if path.is_file():
            return load_file(path) if name.endswith(".safetensors") else torch.load(path, map_location="cpu",
                                                                                      weights_only=True)
    shards = sorted(folder.glob("*.safetensors")) if sharded else []
    if shards:
        return {name: t for shard in shards for name, t in load_file(shard).items()}
    raise ValueError(f"{folder} has no weights of {kind}: expected one of {list(file_names)}")
