"""GGUF files: model config from the metadata, tensors dequantized with the `gguf` package under HF names
and in HF's layout (so every loader hands the model the same thing)."""
from collections.abc import Iterator

import gguf
import numpy as np
import torch

from inferno.config import ModelConfig
from inferno.layers.quantization import GroupQuantized

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

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


def open_gguf(path: str) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError, struct.error, IndexError… on a bad file
        raise ValueError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e


def field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader: gguf.GGUFReader) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}
    hidden = field(reader, f"{arch}.embedding_length")
    heads = field(reader, f"{arch}.attention.head_count")
    vocab = field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=field(reader, f"{arch}.feed_forward_length"),
        num_hidden_layers=field(reader, f"{arch}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=field(reader, f"{arch}.attention.key_length", hidden // heads),
        rms_norm_eps=field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=field(reader, f"{arch}.rope.freq_base", 10000.0),
        max_position_embeddings=field(reader, f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
    )


def unpermute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-rotary row order, back to Hugging Face's rotate-half layout."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    _, layer, rest = gguf_name.split(".", 2)
    return f"model.layers.{layer}.{LAYER_TENSORS[rest]}" if rest in LAYER_TENSORS else None


Q4_BLOCK_SIZE = 32
Q4_TYPES = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)


def q4_codes(tensor: gguf.ReaderTensor) -> GroupQuantized:
    """A Q4_0 / Q4_1 matrix as 4-bit codes with a scale and a min per block of 32, without dequantizing.

    A block is an fp16 scale d (Q4_1: then an fp16 min m) and 16 bytes holding 32 codes, low nibbles first:
    w = q * d + m (Q4_0: w = (q - 8) * d).
    """
    raw = np.asarray(tensor.data)
    rows = raw.shape[0]
    has_min = tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1
    header = 4 if has_min else 2
    blocks = raw.reshape(rows, -1, header + Q4_BLOCK_SIZE // 2)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else -8 * scales
    packed = blocks[..., header:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    return GroupQuantized(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(mins))


def iter_weights(reader: gguf.GGUFReader, config: ModelConfig,
                 group_size: int | None = None) -> Iterator[tuple[str, torch.Tensor | GroupQuantized]]:
    """HF-named weights; with `group_size=32`, Q4_0/Q4_1 projection weights come as 4-bit codes (GroupQuantized)."""
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise ValueError(f"unexpected tensor {tensor.name!r} in GGUF file")
        if (group_size == Q4_BLOCK_SIZE and tensor.tensor_type in Q4_TYPES and name.endswith("proj.weight")):
            w = q4_codes(tensor)
        else:
            w = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                                          dtype=np.float32))  # a writable copy of the memory map
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if name.endswith("q_proj.weight") else config.num_key_value_heads
            w = w.map_rows(lambda t: unpermute_rotary(t, heads)) if isinstance(w, GroupQuantized) \
                else unpermute_rotary(w, heads)
        yield name, w
