"""Hugging Face model folders: config.json and *.safetensors."""
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from inferno.config import ModelConfig, RopeScaling

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.exists():
        raise ValueError(f"{folder} is not a Hugging Face model folder: config.json is missing")
    cfg = json.loads(path.read_text())
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                              rope["original_max_position_embeddings"])
    elif rope_type != "default":
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: llama3)")
    heads = cfg["num_attention_heads"]
    return ModelConfig(
        architecture=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
        rope_scaling=scaling,
    )


def iter_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
