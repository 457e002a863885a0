// The kernel bodies' entry points, one per operator: what ops.cpp calls once it has checked the tensors (dtypes,
// shapes, contiguity as each operator's comment there says) and made the outputs. Each library defines them once,
// compiled for its ISA level; the layouts' sizes are here because both sides read them.
#pragma once

#include "kernel.h"

namespace inferno {

constexpr int64_t TILE_ROWS = 16;  // weight rows per tile (q4_k_tile, q6_k_tile, int4_tile, q8_tile, q5_tile)
constexpr int64_t Q4K_BLOCK_BYTES = 144, Q4K_TILE_BLOCK_BYTES = 2368;  // per super-block of 256 weights
constexpr int64_t Q6K_BLOCK_BYTES = 210, Q6K_TILE_BLOCK_BYTES = 3360;
// per block of 32 columns
constexpr int64_t INT4_TILE_BLOCK_BYTES = 320, Q8_TILE_BLOCK_BYTES = 576, Q5_TILE_BLOCK_BYTES = 352;

// bytes of a row of the int4 layout (quantized_gemv.cpp): K / 2 of codes, then a float16 scale and min per group
constexpr int64_t int4_row_bytes(int64_t k, int64_t group_size) { return k / 2 + 4 * (k / group_size); }

namespace gguf {

// ggml's type numbers (gguf.GGMLQuantizationType)
enum GGMLType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Blocks {
  int64_t block_values, block_bytes;  // 0, 0: a type gguf_repack.cpp does not repack
};

constexpr Blocks blocks_of(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    default: return {0, 0};
  }
}

constexpr int64_t q8_group(int64_t qtype) { return qtype == Q6_K ? 16 : 32; }
constexpr bool q8_has_mins(int64_t qtype) { return qtype == Q4_1 || qtype == Q5_1 || qtype == Q4_K || qtype == Q5_K; }

}  // namespace gguf

namespace cpu {

// paged_attention.cpp, prefill_attention.cpp
void paged_decode_attention(const View& q, const View& k_cache, const View& v_cache, const View& block_tables,
                            const View& seq_lens, double scale, int64_t window, int64_t threads, const View& out);
void paged_prefill_attention(const View& q, const View& k, const View& v, const View& k_cache, const View& v_cache,
                             const View& block_tables, const View& query_start, const View& seq_lens, double scale,
                             int64_t window, const View& out);

// quantized_gemv.cpp
void int8_group_matmul(const View& x, const View& codes, const View& scales, const View& mins, int64_t group_size,
                       const View& y);
void int8_group_dequantize(const View& codes, const View& scales, const View& mins, int64_t group_size,
                           const View& w);
void int8_q8_matmul(const View& x, const View& codes, const View& scales, const View* mins, int64_t group_size,
                    const View& y);
void int4_q8_matmul(const View& x, const View& packed, int64_t group_size, bool zero_points, const View& y);
void int4_dequantize(const View& packed, int64_t k, int64_t group_size, bool zero_points, const View& w);
void int8_q8_dequantize(const View& codes, const View& scales, const View* mins, int64_t group_size, const View& w);
void int4_tile(const View& packed, int64_t k, int64_t group_size, const View& tiles);
void int4_tiles_matmul(const View& x, const View& tiles, bool zero_points, const View& y);
void q8_tile(const View& codes, const View& scales, const View& tiles);
void q8_tiles_matmul(const View& x, const View& tiles, const View& y);

// q5_tiles.cpp
bool q5_tile(const View& codes, const View& scales, const View& tiles);
void q5_tiles_matmul(const View& x, const View& tiles, const View& y);

// q4_k_gemv.cpp, q6_k_gemv.cpp
void q4_k_matmul(const View& x, const View& blocks, const View& y);
void q4_k_dequantize(const View& blocks, const View& w);
void q4_k_tile(const View& blocks, const View& tiles);
void q4_k_tiles_matmul(const View& x, const View& tiles, const View& y);
void q6_k_matmul(const View& x, const View& blocks, const View& y);
void q6_k_dequantize(const View& blocks, const View& w);
void q6_k_tile(const View& blocks, const View& tiles);
void q6_k_tiles_matmul(const View& x, const View& tiles, const View& y);

// gguf_repack.cpp
void gguf_to_int4(const View& raw, int64_t qtype, const View& packed);
void gguf_to_q8(const View& raw, int64_t qtype, const View& codes, const View& scales, const View& mins);

// w8a8_activations.cpp
void w8a8_quantize_rows(const View& x, const float* input_scales, int64_t rotation_block, const View& codes,
                        const View& row_scales);
void w8a8_scale_rows(const View& y, const float* row_scales, const float* bias, const View& out);

// fused_ops.cpp
void rms_norm(const View& x, const View& weight, double eps, const View& out);
void add_rms_norm(const View& x, const View& residual, const View& weight, double eps, const View& out,
                  const View& sum);
void silu_and_mul(const View& gate_up, const View& out);
void rotary(const View& x, const View& rotations, const View& out);

// lora_bgmv.cpp
void lora_bgmv(const View& x, const View& lora_a, const View& lora_b, const View& token_slots,
               const int64_t* slice_sizes, int64_t num_slices, const View& out);

}  // namespace cpu

}  // namespace inferno
