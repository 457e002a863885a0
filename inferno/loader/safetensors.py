"""Hugging Face model folders: config.json and *.safetensors (float, or AWQ / GPTQ 4-bit: loader/awq_gptq.py)."""
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from inferno.config import ModelConfig, MoEConfig, RopeScaling
from inferno.layers.quantization.groups import ZeroPointInt4
from inferno.loader.awq_gptq import group_layers, read_quantization
from inferno.loader.pooler_config import hf_pooler_config

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral",
                         "qwen2_moe", "qwen3_moe", "olmoe")
QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")  # sliding window only with use_sliding_window
GEMMA_TYPES = ("gemma2", "gemma3_text")


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.exists():
        raise ValueError(f"{folder} is not a Hugging Face model folder: config.json is missing")
    cfg = json.loads(path.read_text())
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {cfg['partial_rotary_factor']} is not supported (only 1.0)")
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv {cfg['clip_qkv']} is not supported")
    read_quantization(cfg)  # an unsupported quantization_config fails here, before any weight is read
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    local_rope = None
    if "full_attention" in rope:  # Gemma 3: one rope per layer type
        rope, local_rope = rope["full_attention"], rope.get("sliding_attention", {})
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    gemma = model_type in GEMMA_TYPES
    window = cfg.get("sliding_window") or None
    if model_type in QWEN_TYPES and not cfg.get("use_sliding_window"):
        window = None
    layer_types = cfg.get("layer_types")
    return ModelConfig(
        architecture=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
        attention_bias=model_type in ("qwen2", "qwen2_moe") or cfg.get("attention_bias", False),
        rope_scaling=rope_scaling(rope, cfg, head_dim),
        qk_norm="full" if model_type == "olmoe" else "head" if model_type in ("qwen3", "qwen3_moe", "gemma3_text")
        else None,
        sliding_window=window,
        sliding_layers=None if window is None or layer_types is None
        else [kind == "sliding_attention" for kind in layer_types],
        norm_offset=1.0 if gemma else 0.0,
        sandwich_norms=gemma,
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
        embedding_multiplier=math.sqrt(hidden) if gemma else 1.0,
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
        rope_local_theta=cfg.get("rope_local_base_freq") or (local_rope or {}).get("rope_theta"),
        moe=moe_config(model_type, cfg),
        pooler=hf_pooler_config(folder, cfg),
    )


def rope_scaling(rope: dict, cfg: dict, head_dim: int) -> RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling("linear", rope["factor"])
    if rope_type == "llama3":
        return RopeScaling("llama3", rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                           rope["original_max_position_embeddings"])
    if rope_type in ("longrope", "su"):
        original = rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        factor = rope.get("factor") or cfg["max_position_embeddings"] / original
        attention_factor = rope.get("attention_factor") or (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)
        for key in ("short_factor", "long_factor"):
            if len(rope[key]) != head_dim // 2:
                raise ValueError(f"rope {key} has {len(rope[key])} entries, expected head_dim / 2 = {head_dim // 2}")
        return RopeScaling("longrope", factor, original_max_position_embeddings=original,
                           short_factor=rope["short_factor"], long_factor=rope["long_factor"],
                           attention_factor=attention_factor)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: linear, llama3, longrope)")


def moe_config(model_type: str, cfg: dict) -> MoEConfig | None:
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if model_type == "mixtral":
        return MoEConfig(num_experts, cfg["num_experts_per_tok"], cfg["intermediate_size"],
                         norm_topk_prob=True)
    if model_type == "olmoe":
        return MoEConfig(num_experts, cfg["num_experts_per_tok"], cfg["intermediate_size"],
                         norm_topk_prob=cfg.get("norm_topk_prob", False))
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step = cfg.get("decoder_sparse_step", 1)
        dense = [i for i in range(cfg["num_hidden_layers"])
                 if i in cfg.get("mlp_only_layers", []) or step < 1 or (i + 1) % step != 0]
        return MoEConfig(num_experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                         norm_topk_prob=cfg.get("norm_topk_prob", False),
                         shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
                         dense_layers=dense)
    return None


def iter_weights(folder: Path, native_int4: bool = False) -> Iterator[tuple[str, torch.Tensor | ZeroPointInt4]]:
    """The checkpoint's tensors; an AWQ / GPTQ checkpoint's quantized layers as `<layer>.weight`, their 4-bit codes
    (`native_int4`: for the int4 kernel) or those dequantized to float32."""
    quant = read_quantization(json.loads((folder / "config.json").read_text()))
    tensors = iter_tensors(folder)
    return tensors if quant is None else group_layers(tensors, quant, native_int4)


def iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def is_quantized(folder: Path) -> bool:
    return read_quantization(json.loads((folder / "config.json").read_text())) is not None
