"""GGUF files: model config from the metadata, tensors under HF names and in HF's layout (so every loader hands
the model the same thing): quantized blocks repacked for the kernels (gguf_blocks.py) or dequantized to float with
the `gguf` package."""
from collections.abc import Iterator

import gguf
import numpy as np
import torch

from inferno.config import ModelConfig
from inferno.layers.quantization.q4_k import Q4KBlocks
from inferno.layers.quantization.q6_k import Q6KBlocks
from inferno.layers.quantization.groups import GroupQuantized, Q8Groups
from inferno.loader.pooler_config import gguf_pooler_config
from inferno.loader.gguf_architectures import (EXPERT_TENSORS, architecture_options, layer_tensor_overrides,
                                               to_hf_layout)
from inferno.kernels import gguf_repack
from inferno.layers.quantization.native import GGUFRows
from inferno.loader.gguf_blocks import INT4_TYPES, Q8_TYPES, Int4Blocks, int4_groups, int4_rows, q6_k_blocks, q8_groups
from inferno.loader.gguf_file import GGUFFile, GGUFTensor

T = gguf.GGMLQuantizationType
Blocks = GGUFRows | GroupQuantized | Int4Blocks | Q4KBlocks | Q6KBlocks | Q8Groups  # quantized blocks in a kernel's form

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen2moe", "qwen3moe", "olmoe")

# GGUF tensor name (without "blk.N.") -> Hugging Face name (without "model.layers.N.")
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}


def open_gguf(path: str) -> GGUFFile:
    ops = gguf_repack()
    return GGUFFile(path, None if ops is None else ops.gguf_string_offsets)


def read_config(gguf_file: GGUFFile) -> ModelConfig:
    field = gguf_file.field
    arch = field("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    names = {t.name for t in gguf_file.tensors}
    hidden = field(f"{arch}.embedding_length")
    heads = field(f"{arch}.attention.head_count")
    vocab = field(f"{arch}.vocab_size") or len(field("tokenizer.ggml.tokens", ()))
    required = {"embedding_length": hidden, "attention.head_count": heads, "block_count": field(f"{arch}.block_count"),
                "feed_forward_length": field(f"{arch}.feed_forward_length"), "vocab_size": vocab}
    missing = [f"{arch}.{key}" for key, value in required.items() if not value]
    if missing:
        raise ValueError(f"GGUF file {gguf_file.path} lacks metadata {', '.join(missing)}")
    head_dim = field(f"{arch}.attention.key_length", hidden // heads)
    tensors = {t.name: t for t in gguf_file.tensors}
    options = dict(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=field(f"{arch}.feed_forward_length"),
        num_hidden_layers=field(f"{arch}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=field(f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=field(f"{arch}.rope.freq_base", 10000.0),
        max_position_embeddings=field(f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
    )
    options.update(architecture_options(arch, field, names, lambda name: float_weight(tensors[name]), hidden, heads,
                                        head_dim, options["num_hidden_layers"]))
    return ModelConfig(**options, pooler=gguf_pooler_config(field, arch))


def unpermute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-rotary row order, back to Hugging Face's rotate-half layout."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str, arch: str) -> str | None:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    if gguf_name.startswith("rope_factors_"):  # Phi-3's LongRoPE factors, read into the config
        return gguf_name
    _, layer, rest = gguf_name.split(".", 2)
    names = {**LAYER_TENSORS, **layer_tensor_overrides(arch)}
    return f"model.layers.{layer}.{names[rest]}" if rest in names else None


FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def native_weight(tensor: GGUFTensor, name: str, native: str, tied: bool = True) -> Blocks | None:
    """The tensor's blocks in a form a kernel runs, or None where it is to become float. `native` "auto": every
    quantized projection (Q4_0 / Q4_1 in the int4 layout, Q4_K and Q6_K as stored, the others as Q8 groups), the token
    embedding and the LM head (Q6_K as stored, the others as Q8 groups, which hold every type exactly; an embedding
    not `tied` to the LM head as stored, its rows converted when looked up); "q4": only Q4_0 / Q4_1 projections
    (explicit int4 / int8 with groups of 32); "none": nothing."""
    qtype = tensor.tensor_type
    if native == "none" or qtype in FLOAT_TYPES:
        return None
    projection = name.endswith("proj.weight") and not name.endswith(
        ("qkv_proj.weight", "gate_up_proj.weight"))  # Phi-3's fused ones are split as float
    if native == "q4":
        return int4_groups(tensor.data, qtype) if projection and qtype in INT4_TYPES else None
    if projection and qtype == T.Q4_K:
        return Q4KBlocks(tensor.rows())  # a view of the file's memory map, as Q6_K's
    if projection and qtype in INT4_TYPES:
        return int4_rows(tensor.data, qtype)
    if name == "model.embed_tokens.weight" and not tied and qtype in Q8_TYPES and gguf_repack() is not None:
        return GGUFRows(tensor.rows(), qtype)
    if projection or name in ("model.embed_tokens.weight", "lm_head.weight"):
        return q6_k_blocks(tensor.rows()) if qtype == T.Q6_K else q8_groups(tensor.data, qtype)
    return None


def float_weight(tensor: GGUFTensor) -> torch.Tensor:
    try:
        w = gguf.quants.dequantize(tensor.data.view(np.ndarray), tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which cannot be read") from e
    return torch.from_numpy(np.asarray(w, dtype=np.float32).reshape(tensor.shape))


def iter_weights(gguf_file: GGUFFile, config: ModelConfig,
                 native: str = "none") -> Iterator[tuple[str, torch.Tensor | Blocks]]:
    """HF-named weights, float tensors or (see `native_weight`) quantized blocks repacked without dequantizing."""
    if native not in ("none", "q4", "auto"):
        raise ValueError(f"native must be 'none', 'q4' or 'auto', got {native!r}")
    arch = gguf_file.field("general.architecture")
    for tensor in gguf_file.tensors:
        layer_name = tensor.name.split(".", 2)[-1]
        if layer_name in EXPERT_TENSORS:  # [experts, rows, columns] -> one tensor per expert, blocks kept
            prefix = f"model.layers.{tensor.name.split('.')[1]}.mlp.experts"
            for e in range(tensor.shape[0]):
                expert = GGUFTensor(f"{tensor.name}[{e}]", tensor.tensor_type, tensor.shape[1:], tensor.data[e],
                                    tensor.file_bytes)
                name = f"{prefix}.{e}.{EXPERT_TENSORS[layer_name]}.weight"
                w = native_weight(expert, name, native)
                yield name, float_weight(expert) if w is None else w
            continue
        name = hf_name(tensor.name, arch)
        if name is None:
            raise ValueError(f"unexpected tensor {tensor.name!r} in GGUF file")
        if name.startswith("rope_factors_"):
            continue
        w = native_weight(tensor, name, native, config.tie_word_embeddings)
        if w is None:
            w = to_hf_layout(arch, name, float_weight(tensor))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if name.endswith("q_proj.weight") else config.num_key_value_heads
            w = unpermute_rotary(w, heads) if isinstance(w, torch.Tensor) \
                else w.map_rows(lambda t: unpermute_rotary(t, heads))
        yield name, w
