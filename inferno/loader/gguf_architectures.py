"""What each GGUF architecture adds to the Llama shape: config options read from llama.cpp's metadata (and, for
Phi-3's LongRoPE, its factor tensors), the tensor names that differ, and llama.cpp's weight conventions undone so
the model gets Hugging Face's layout."""
import math
from collections.abc import Callable

import torch

from inferno.config import MoEConfig, RopeScaling

GEMMA = ("gemma2", "gemma3")
MOE = ("qwen2moe", "qwen3moe", "olmoe")  # and `llama` files with experts (Mixtral)
# GGUF architecture -> HF model_type, where they differ
MODEL_TYPES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# per architecture, GGUF tensor names (without "blk.N.") whose HF names differ from the Llama shape's
LAYER_TENSOR_OVERRIDES = {
    "gemma": {"post_attention_norm.weight": "post_attention_layernorm.weight",
              "ffn_norm.weight": "pre_feedforward_layernorm.weight",
              "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
}
# routed experts stacked [experts, rows, columns]: split into one HF tensor per expert
EXPERT_TENSORS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                  "ffn_down_exps.weight": "down_proj"}
MOE_TENSORS = {"ffn_gate_inp.weight": "mlp.gate.weight",
               "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
               "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
               "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
               "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}
# llama.cpp renormalises the chosen experts' weights for these (unless the file says otherwise)
NORM_TOPK_PROB = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}


def layer_tensor_overrides(arch: str) -> dict[str, str]:
    return {**LAYER_TENSOR_OVERRIDES.get("gemma" if arch in GEMMA else arch, {}), **MOE_TENSORS}


def architecture_options(arch: str, field: Callable, names: set[str], tensor: Callable[[str], torch.Tensor],
                         hidden: int, heads: int, head_dim: int, layers: int) -> dict:
    """ModelConfig fields beyond the Llama shape."""
    options = {"architecture": MODEL_TYPES.get(arch, arch)}
    if "blk.0.attn_q_norm.weight" in names:
        full = arch == "olmoe"  # OLMoE normalises all heads' q (and k) together
        options["qk_norm"] = "full" if full else "head"
    window = field(f"{arch}.attention.sliding_window")
    if window:
        options["sliding_window"] = window
    if arch in GEMMA:
        # llama.cpp's patterns: Gemma 2 alternates sliding and global layers, Gemma 3 has one global in six
        options["sliding_layers"] = [i % 2 == 0 if arch == "gemma2" else (i + 1) % 6 != 0 for i in range(layers)]
        options.update(norm_offset=1.0, sandwich_norms=True, hidden_act="gelu_pytorch_tanh",
                       embedding_multiplier=math.sqrt(hidden),
                       attn_logit_softcapping=field(f"{arch}.attn_logit_softcapping"),
                       final_logit_softcapping=field(f"{arch}.final_logit_softcapping"),
                       # llama.cpp: hidden / heads for the 27B models (46 and 62 layers), else the head size
                       query_pre_attn_scalar=hidden // heads if layers in (46, 62) else head_dim)
        if arch == "gemma3":
            options["rope_local_theta"] = 10000.0
    if field(f"{arch}.rope.scaling.type") == "linear":
        options["rope_scaling"] = RopeScaling("linear", field(f"{arch}.rope.scaling.factor"))
    if "rope_factors_long.weight" in names:  # Phi-3 LongRoPE
        original = field(f"{arch}.rope.scaling.original_context_length")
        factor = field(f"{arch}.context_length") / original
        options["rope_scaling"] = RopeScaling(
            "longrope", factor, original_max_position_embeddings=original,
            short_factor=tensor("rope_factors_short.weight").tolist(),
            long_factor=tensor("rope_factors_long.weight").tolist(),
            attention_factor=field(f"{arch}.rope.scaling.attn_factor")
            or (math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0))
    experts = field(f"{arch}.expert_count")
    if experts:
        shared = field(f"{arch}.expert_shared_feed_forward_length", 0)
        options["moe"] = MoEConfig(
            experts, field(f"{arch}.expert_used_count"),
            field(f"{arch}.expert_feed_forward_length") or field(f"{arch}.feed_forward_length"),
            norm_topk_prob=field(f"{arch}.expert_weights_norm", NORM_TOPK_PROB[arch]),
            shared_expert_intermediate_size=shared,
            dense_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names])
        if arch == "llama":
            options["architecture"] = "mixtral"
    return options


def to_hf_layout(arch: str, name: str, w: torch.Tensor) -> torch.Tensor:
    """Undo llama.cpp's conventions on a float tensor: Gemma's norms are stored as (1 + w)."""
    if arch in GEMMA and name.endswith("norm.weight"):
        return w - 1.0
    return w
