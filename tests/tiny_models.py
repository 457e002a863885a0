"""Tiny random models of each architecture: saved as HF folders by transformers (the numeric oracle) and written as
GGUF files from the same weights with `gguf.GGUFWriter`, under llama.cpp's tensor names and conventions."""
import json
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tiny_gguf import byte_level_tokens

VOCAB = len(byte_level_tokens())  # 256 byte tokens and 2 control tokens; prompts are token ids below 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=VOCAB - 1,
              initializer_range=0.1)  # logits spread wide enough for clear greedy choices
# architecture -> (config class, model class, config overrides)
ARCHITECTURES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1e6, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=32, tie_word_embeddings=False)),
}


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer without merges: token id = byte (then two control tokens)."""
    tokens = byte_level_tokens()
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": tokens[-1]}))


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
}


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{GGUF_LAYER_NAMES[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def write_gguf(path: Path, hf_model: torch.nn.Module, arch: str) -> Path:
    """The HF model's float32 weights and shape as a GGUF file of `arch`, with the byte-level vocabulary."""
    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    tokens = byte_level_tokens()
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 2)
    writer.add_token_merges([])
    writer.add_eos_token_id(len(tokens) - 1)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        writer.add_tensor(gguf_name(name), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
