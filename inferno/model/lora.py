"""Where LoRA adapters attach to the decoder: PEFT's target modules (Hugging Face's projection names) mapped onto the
model's fused projections, and the `LoRAStack` each of those gets when the engine serves adapters."""
import torch

from inferno.config import ModelConfig
from inferno.layers.lora import LoRAStack
from inferno.model.llama import LlamaForCausalLM

# PEFT target module -> (the model's projection, stack attribute of its block, slice of its output)
TARGET_MODULES = {
    "q_proj": ("self_attn", "qkv_lora", 0), "k_proj": ("self_attn", "qkv_lora", 1),
    "v_proj": ("self_attn", "qkv_lora", 2), "o_proj": ("self_attn", "o_lora", 0),
    "gate_proj": ("mlp", "gate_up_lora", 0), "up_proj": ("mlp", "gate_up_lora", 1),
    "down_proj": ("mlp", "down_lora", 0),
}


def lora_shapes(config: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Per stack attribute: (input features, output slice sizes) of the projection it adapts (the whole model:
    LoRA runs on one rank)."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, intermediate = config.hidden_size, config.intermediate_size
    return {"qkv_lora": (hidden, [q, kv, kv]), "o_lora": (q, [hidden]),
            "gate_up_lora": (hidden, [intermediate, intermediate]), "down_lora": (intermediate, [hidden])}


def check_supports_lora(config: ModelConfig) -> None:
    if config.moe is not None:
        raise ValueError(f"LoRA adapters are not supported on mixture-of-experts models ({config.architecture})")


def attach_lora_stacks(model: LlamaForCausalLM, num_slots: int, max_rank: int, dtype: torch.dtype,
                       device: torch.device) -> dict[tuple[int, str], LoRAStack]:
    """A zeroed stack on every adaptable projection of every layer; returns them by (layer, stack attribute)."""
    check_supports_lora(model.config)
    stacks = {}
    for layer in model.stage_layers:
        decoder = model.layers[layer]
        for attr, (in_features, slices) in lora_shapes(model.config).items():
            block = decoder.self_attn if attr in ("qkv_lora", "o_lora") else decoder.mlp
            stack = LoRAStack(in_features, slices, num_slots, max_rank, dtype, device)
            setattr(block, attr, stack)
            stacks[layer, attr] = stack
    return stacks
