"""How a checkpoint pools embeddings: a sentence-transformers folder's modules (Pooling, Normalize), a GGUF file's
`<arch>.pooling_type`, or by default the last token's hidden state, normalized (as Qwen3-Embedding)."""
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inferno.config import PoolerConfig

# sentence-transformers' pooling modes -> vLLM's pooling types: "pooling_mode": "<mode>" (version 6), or one
# "pooling_mode_<mode>": true among the older files' flags
ST_POOLING_MODES = {"lasttoken": "LAST", "mean": "MEAN", "mean_tokens": "MEAN", "cls": "CLS", "cls_token": "CLS"}
# llama.cpp's enum llama_pooling_type: 0 none, 1 mean, 2 cls, 3 last, 4 rank
GGUF_POOLING_TYPES = {1: "MEAN", 2: "CLS", 3: "LAST"}


def hf_pooler_config(folder: Path, hf_config: dict) -> PoolerConfig:
    """From `modules.json` when the folder is a sentence-transformers model; Matryoshka dimensions from config.json
    (`matryoshka_dimensions`, or `is_matryoshka`: any length), as vLLM reads them."""
    dimensions = hf_config.get("matryoshka_dimensions")
    if dimensions is None and hf_config.get("is_matryoshka"):
        dimensions = []
    modules_file = folder / "modules.json"
    if not modules_file.exists():
        return PoolerConfig(matryoshka_dimensions=dimensions)
    modules = json.loads(modules_file.read_text())
    kinds = {m["type"].rpartition(".")[2]: m for m in modules}  # the class name, wherever a version puts it
    unsupported = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if unsupported:
        raise ValueError(f"{modules_file}: sentence-transformers modules {unsupported} are not supported (only "
                         "Transformer, Pooling and Normalize)")
    pooling_type = "LAST"
    if "Pooling" in kinds:
        pooling_type = st_pooling_type(json.loads((folder / kinds["Pooling"]["path"] / "config.json").read_text()))
    return PoolerConfig(pooling_type, "Normalize" in kinds, dimensions)


def st_pooling_type(pooling: dict) -> str:
    modes = pooling.get("pooling_mode")
    if modes is None:
        modes = [name.removeprefix("pooling_mode_") for name, value in pooling.items()
                 if name.startswith("pooling_mode_") and value]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in ST_POOLING_MODES:
        raise ValueError(f"sentence-transformers pooling {modes} is not supported (supported: lasttoken, mean, cls)")
    if pooling.get("include_prompt") is False:
        raise ValueError("sentence-transformers pooling with include_prompt=False is not supported")
    return ST_POOLING_MODES[modes[0]]


def gguf_pooler_config(field: Callable[[str, Any], Any], arch: str) -> PoolerConfig:
    """`<arch>.pooling_type` when the file has it (none and rank pool the last token), normalized."""
    return PoolerConfig(GGUF_POOLING_TYPES.get(field(f"{arch}.pooling_type", None), "LAST"))
