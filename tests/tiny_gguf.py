"""Tiny random GGUF models of every block type, written with `gguf.GGUFWriter` (for the loader's tests)."""
from pathlib import Path

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2  # rows of 256: whole K-quant super-blocks
# scale fields (float16) per block type, byte offsets, with the magnitude that keeps weights around 0.1
SCALE_FIELDS = {T.Q4_K: ((0, 2e-3), (2, 2e-3)), T.Q5_K: ((0, 1e-3), (2, 1e-3)), T.Q6_K: ((208, 2e-4),)}


def byte_level_tokens() -> list[str]:
    """GPT-2's 256 byte tokens (printable stand-ins for every byte), then two control tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    chars = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    return [chars[b] for b in range(256)] + ["<|endoftext|>", "<|im_end|>"]


def add_byte_level_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The byte-level vocabulary above as the file's GPT-2-style tokenizer, the last control token as EOS."""
    tokens = byte_level_tokens()
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 2)
    writer.add_token_merges([])
    writer.add_eos_token_id(len(tokens) - 1)


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks [rows, bytes per row] for `qtype`: `gguf.quants.quantize` of random weights where the package
    can quantize the type; random bytes with small float16 scales for the K-quants (every byte pattern is data)."""
    if qtype in (T.F32, T.F16):
        return (0.1 * rng.standard_normal((rows, cols))).astype(np.float32 if qtype == T.F32 else np.float16)
    if qtype not in SCALE_FIELDS:
        return gguf.quants.quantize((0.1 * rng.standard_normal((rows, cols))).astype(np.float32), qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for offset, magnitude in SCALE_FIELDS[qtype]:
        scale = rng.uniform(0.2 * magnitude, magnitude, blocks.shape[:2]).astype(np.float16)
        blocks[..., offset:offset + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(path: Path, types: dict[str, T] | T, arch: str = "qwen2", tied: bool = True,
                    seed: int = 0) -> Path:
    """A random 2-layer model; `types` maps a GGUF tensor kind ("attn_q", "ffn_down", "token_embd", "output", ...)
    to its block type (missing kinds: Q8_0), or one type for every matrix. Norms and biases are float32."""
    rng = np.random.default_rng(seed)
    tokens = byte_level_tokens()
    kind_of = (lambda kind: types.get(kind, T.Q8_0)) if isinstance(types, dict) else (lambda kind: types)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    add_byte_level_tokenizer(writer)

    def matrix(name: str, kind: str, rows: int, cols: int) -> None:
        qtype = kind_of(kind)
        data = random_blocks(qtype, rows, cols, rng)
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)

    def vector(name: str, size: int, center: float) -> None:
        writer.add_tensor(name, (center + 0.1 * rng.standard_normal(size)).astype(np.float32))

    head_dim = HIDDEN // HEADS
    matrix("token_embd.weight", "token_embd", len(tokens), HIDDEN)
    vector("output_norm.weight", HIDDEN, 1.0)
    if not tied:
        matrix("output.weight", "output", len(tokens), HIDDEN)
    for i in range(LAYERS):
        vector(f"blk.{i}.attn_norm.weight", HIDDEN, 1.0)
        vector(f"blk.{i}.ffn_norm.weight", HIDDEN, 1.0)
        for kind, rows in (("attn_q", HIDDEN), ("attn_k", KV_HEADS * head_dim), ("attn_v", KV_HEADS * head_dim)):
            matrix(f"blk.{i}.{kind}.weight", kind, rows, HIDDEN)
            if arch == "qwen2":
                vector(f"blk.{i}.{kind}.bias", rows, 0.0)
        matrix(f"blk.{i}.attn_output.weight", "attn_output", HIDDEN, HIDDEN)
        matrix(f"blk.{i}.ffn_gate.weight", "ffn_gate", INTERMEDIATE, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", "ffn_up", INTERMEDIATE, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", "ffn_down", HIDDEN, INTERMEDIATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
