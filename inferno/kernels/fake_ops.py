"""The shapes of the native operators for torch.compile's tracing (their schemas are in ops.cpp), registered once
the kernel library is loaded."""
import gguf
import torch

T = gguf.GGMLQuantizationType

TILE_ROWS = 16  # weight rows per tile of q4_k_tile, q6_k_tile, int4_tile, q8_tile and q5_tile (entry_points.h)

# the types whose blocks carry a min: gguf_to_q8 returns their mins (an empty tensor for the others)
Q8_WITH_MINS = {T.Q4_1, T.Q4_K, T.Q5_1, T.Q5_K}


def register_fake_ops():
    register_attention()
    register_quantized_gemv()
    for qtype in (T.Q4_K, T.Q6_K):
        register_super_block_gemv(qtype)
    register_gguf_repack()
    register_w8a8_activations()
    register_fused_ops()
    register_lora_bgmv()
    register_dense_linear()


def register_attention():
    @torch.library.register_fake("inferno::paged_decode_attention")
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale, window=0, threads=0):
        return torch.empty_like(q)

    @torch.library.register_fake("inferno::paged_prefill_attention")
    def _(q, k, v, k_cache, v_cache, block_tables, query_start, seq_lens, scale, window=0):
        return q.new_empty(q.shape)


def register_quantized_gemv():
    @torch.library.register_fake("inferno::int8_group_matmul")
    def _(x, codes, scales, mins, group_size):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("inferno::int8_group_dequantize")
    def _(codes, scales, mins, group_size):
        return scales.new_empty(codes.shape)

    @torch.library.register_fake("inferno::int8_q8_matmul")
    def _(x, codes, scales, mins, group_size):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("inferno::int4_q8_matmul")
    def _(x, packed, group_size, zero_points=False):
        return x.new_empty(x.shape[0], packed.shape[0])

    @torch.library.register_fake("inferno::int4_dequantize")
    def _(packed, k, group_size, dtype, zero_points=False):
        return packed.new_empty(packed.shape[0], k, dtype=dtype)

    @torch.library.register_fake("inferno::int8_q8_dequantize")
    def _(codes, scales, mins, group_size, dtype):
        return scales.new_empty(codes.shape, dtype=dtype)

    @torch.library.register_fake("inferno::int4_tiles_matmul")
    def _(x, tiles, zero_points=False):
        return x.new_empty(x.shape[0], tiles.shape[0] * TILE_ROWS)

    @torch.library.register_fake("inferno::q8_tiles_matmul")
    def _(x, tiles):
        return x.new_empty(x.shape[0], tiles.shape[0] * TILE_ROWS)

    @torch.library.register_fake("inferno::q5_tiles_matmul")
    def _(x, tiles):
        return x.new_empty(x.shape[0], tiles.shape[0] * TILE_ROWS)


def register_super_block_gemv(qtype: T):
    """`{type}_matmul`, `{type}_dequantize` and `{type}_tiles_matmul` of `{type}_gemv.cpp`."""
    op = qtype.name.lower()
    values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]

    @torch.library.register_fake(f"inferno::{op}_matmul")
    def _(x, blocks):
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake(f"inferno::{op}_dequantize")
    def _(blocks, dtype):
        return blocks.new_empty(blocks.shape[0], blocks.shape[1] // block_bytes * values, dtype=dtype)

    @torch.library.register_fake(f"inferno::{op}_tiles_matmul")
    def _(x, tiles):
        return x.new_empty(x.shape[0], tiles.shape[0] * TILE_ROWS)


def register_gguf_repack():
    @torch.library.register_fake("inferno::gguf_to_q8")
    def _(raw, qtype):  # an embedding converts the rows it looks up
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[T(qtype)]
        k = raw.shape[1] // block_bytes * block_values
        scales = raw.new_empty(raw.shape[0], k // (16 if qtype == T.Q6_K else 32), dtype=torch.float)
        return (raw.new_empty(raw.shape[0], k, dtype=torch.int8), scales,
                torch.empty_like(scales) if qtype in Q8_WITH_MINS else raw.new_empty(0, dtype=torch.float))


def register_w8a8_activations():
    @torch.library.register_fake("inferno::w8a8_quantize_rows")
    def _(x, input_scales, rotation_block):
        return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(x.shape[0], 1, dtype=torch.float)

    @torch.library.register_fake("inferno::w8a8_scale_rows")
    def _(y, row_scales, bias, out):
        return None


def register_fused_ops():
    @torch.library.register_fake("inferno::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("inferno::add_rms_norm")
    def _(x, residual, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("inferno::silu_and_mul")
    def _(gate_up):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake("inferno::rotary")
    def _(x, rotations):
        return x.new_empty(x.shape)


def register_lora_bgmv():
    @torch.library.register_fake("inferno::lora_bgmv")
    def _(x, lora_a, lora_b, token_slots, slice_sizes):
        return x.new_empty(x.shape[0], lora_b.shape[2])


def register_dense_linear():
    @torch.library.register_fake("inferno::dense_linear")
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])
