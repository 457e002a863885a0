"""Tiny random models of each architecture: saved as HF folders by transformers (the numeric oracle) and written as
GGUF files from the same weights with `gguf.GGUFWriter`, under llama.cpp's tensor names and conventions."""
import json
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tiny_gguf import add_byte_level_tokenizer, byte_level_tokens

VOCAB = len(byte_level_tokens())  # 256 byte tokens and 2 control tokens; prompts are token ids below 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=VOCAB - 1,
              initializer_range=0.1)  # logits spread wide enough for clear greedy choices
# architecture -> (config class, model class, config overrides)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1e6, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=32, tie_word_embeddings=False)),
    # Gemma: a sliding layer then a global one, window 32; caps low enough to bite; scalar unlike the head size;
    # HF's eager attention, the one that soft-caps scores (transformers 5.17 picks SDPA, which leaves them uncapped)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, sliding_window=32, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, pad_token_id=0, attn_implementation="eager")),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, sliding_window=32, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
        pad_token_id=0)),
    # experts: 8 of inner size 32, 2 per token; qwen3_moe's second layer dense (mlp_only_layers)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, tie_word_embeddings=False,
        sliding_window=None)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1], tie_word_embeddings=False)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, intermediate_size=32, pad_token_id=0, tie_word_embeddings=False)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=0, tie_word_embeddings=False, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + 0.1 * i for i in range(8)],
                         "long_factor": [2.0 + 0.5 * i for i in range(8)]})),
}


def write_tokenizer(folder: Path, vocab_size: int = VOCAB) -> None:
    """A byte-level BPE tokenizer without merges: token id = byte (then two control tokens); beyond those, up to
    `vocab_size`, plain-text tokens that encoding never produces but decoding spells out."""
    tokens = byte_level_tokens() + [f"tok{i}" for i in range(VOCAB, vocab_size)]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": tokens[VOCAB - 1]}))


def write_hf_model(folder: Path, arch: str, **overrides) -> torch.nn.Module:
    """A random model of `arch` saved in `folder` (with a tokenizer); returns the HF model, in eval mode."""
    config_class, model_class, arch_overrides = ARCHITECTURES[arch]
    config = getattr(transformers, config_class)(**{**COMMON, **arch_overrides, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so that loading them wrong shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model.eval()


# HF tensor name (without "model.layers.N.") -> llama.cpp's (without "blk.N.")
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused projections
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",  # mixture of experts
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
MOE_ARCHITECTURES = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}


def llama_cpp_rotary_order(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's `llama` files hold q/k rows in interleaved rotary order."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(hf_model: torch.nn.Module, arch: str):
    """(GGUF name, float32 array) for each weight: stacked experts split into gate / up / down."""
    config = hf_model.config
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("experts.gate_up_proj"):  # [experts, 2 * inner, hidden]
            layer = name.split(".")[2]
            gate, up = tensor.chunk(2, dim=1)
            yield f"blk.{layer}.ffn_gate_exps.weight", gate.float().numpy()
            yield f"blk.{layer}.ffn_up_exps.weight", up.float().numpy()
            continue
        if name.endswith("experts.down_proj"):
            yield f"blk.{name.split('.')[2]}.ffn_down_exps.weight", tensor.float().numpy()
            continue
        if arch.startswith("gemma") and name.endswith("norm.weight"):  # llama.cpp stores Gemma's (1 + w)
            tensor = tensor + 1
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            tensor = llama_cpp_rotary_order(tensor, heads)
        yield gguf_name(name, arch), tensor.float().numpy()


GEMMA_LAYER_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                     "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf_name: str, arch: str) -> str:
    if hf_name.startswith("model.layers."):
        layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
        module, kind = rest.rsplit(".", 1)
        names = {**GGUF_LAYER_NAMES, **GEMMA_LAYER_NAMES} if arch.startswith("gemma") else GGUF_LAYER_NAMES
        return f"blk.{layer}.{names[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def write_gguf(path: Path, hf_model: torch.nn.Module, arch: str, expert_type: gguf.GGMLQuantizationType | None = None,
               projection_type: gguf.GGMLQuantizationType | None = None) -> Path:
    """The HF model's float32 weights and shape as a GGUF file of `arch`, with the byte-level vocabulary; the stacked
    experts quantized to `expert_type` if given (llama.cpp's `ffn_*_exps`, blocks along each expert's rows), the
    decoder layers' projections to `projection_type` if given."""
    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if rope.get("rope_type") == "longrope":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    add_byte_level_tokenizer(writer)
    if hasattr(config, "num_experts_per_tok"):
        writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if hasattr(config, "moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", 0):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    for name, array in gguf_tensors(hf_model, arch):
        if expert_type is not None and "_exps." in name:
            writer.add_tensor(name, gguf.quants.quantize(array, expert_type), raw_dtype=expert_type)
        elif projection_type is not None and name.startswith("blk.") and array.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(array, projection_type), raw_dtype=projection_type)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
