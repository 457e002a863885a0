// What the quantized kernels share (quantized_gemv.cpp, q5_tiles.cpp, q4_k_gemv.cpp, q6_k_gemv.cpp,
// gguf_repack.cpp): the rows of x quantized to int8 per block of 32, the passes over row blocks of x, float16 reads,
// K-quant scales, the passes of the super-block matmul operators and the float32 / bfloat16 output of the
// dequantizers. Everything here has internal linkage (each kernel file its own copy).
#pragma once

#include "entry_points.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX2__)
inline float sum_lanes256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// Weights are read once per step, so they come from memory: the kernels prefetch about 2 KB ahead of the row they
// work on (cold int4 weights stream about twice as fast with it).
constexpr int64_t PREFETCH_BYTES = 2048;

// Prefetches the PREFETCH_BYTES after each cache line of the `bytes` at `row` (the row about to be read).
inline void prefetch_ahead(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row) + PREFETCH_BYTES;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}
constexpr int64_t AVX2_ROW_BLOCK = 4;  // rows of x per pass over the weights in 256-bit kernels (16 registers)

// Calls run(std::integral_constant<int64_t, R>{}, r) for row blocks [r, r + R) of x covering [0, m): R = MAX_R,
// then one smaller block for the rest (each row block is one pass over the weights).
template <int64_t R, typename Run>
void run_rows(int64_t count, int64_t r, Run& run) {
  if constexpr (R > 0) {
    if (count == R) run(std::integral_constant<int64_t, R>{}, r);
    else run_rows<R - 1>(count, r, run);
  }
}

template <int64_t MAX_R, typename Run>
void for_row_blocks(int64_t m, Run&& run) {
  int64_t r = 0;
  for (; r + MAX_R <= m; r += MAX_R) run(std::integral_constant<int64_t, MAX_R>{}, r);
  run_rows<MAX_R - 1>(m - r, r, run);
}

// The rows of x are quantized like a GGUF Q8_0 / Q8_1 block: x ~ xq * xs per block of 32 (absmax / 127), with the
// sum of the block's codes (exact, an integer) and xs times it. Every term of a product multiplies the same rounded
// activations, min terms included (as llama.cpp's Q8_1 blocks do): sum w * (xs * xq) differs from the exact sum by
// sum w * e for rounding errors e, where the float sum of x in the min terms would leave sum (w - min) * e, several
// times larger for weights whose min sits far below their mean (Q4_1, Q4_K).
constexpr int64_t X_BLOCK = 32;

struct QuantizedRows {  // the rows of x, quantized per block of 32
  std::vector<int8_t> codes;     // [M, K]
  std::vector<float> scales;     // [M, K / 32]
  std::vector<int32_t> code_sums;  // [M, K / 32]
  std::vector<float> sums;       // [M, K / 32]: of the rounded values, xs * code sum
};

struct QuantizedBlock {  // a block of x: its scale, the sum of its codes, the sum of its rounded values
  float scale;
  int32_t code_sum;
  float sum;
};

// A block of x: amax / 127 as its scale, codes nearbyint(x * (127 / amax)) (round half to even, as the vector
// paths' conversion under the default rounding mode) written to `codes`, their sum.
inline QuantizedBlock quantize_block(const float* xb, int8_t* codes) {
#if defined(__AVX512F__)
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), c1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(c0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16), _mm512_cvtepi32_epi8(c1));
  const int32_t code_sum = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
#elif defined(__AVX2__)
  __m256 v[4];
  __m256 amax8 = _mm256_setzero_ps();
  for (int64_t i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i c[4];
  for (int64_t i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // packs interleave the 128-bit lanes: 32-bit groups 0 4 1 5 2 6 3 7 back in order
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), bytes);
  const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  const int32_t code_sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
#else
  float amax = 0.f;
  for (int64_t i = 0; i < X_BLOCK; ++i) amax = std::max(amax, std::abs(xb[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t code_sum = 0;
  for (int64_t i = 0; i < X_BLOCK; ++i) {
    const int8_t c = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
    codes[i] = c;
    code_sum += c;
  }
#endif
  const float scale = amax / 127.f;
  return {scale, code_sum, scale * static_cast<float>(code_sum)};
}

inline QuantizedRows quantize_rows(const float* x, int64_t m, int64_t k) {
  const int64_t blocks = m * k / X_BLOCK;
  QuantizedRows q{std::vector<int8_t>(m * k), std::vector<float>(blocks), std::vector<int32_t>(blocks),
                  std::vector<float>(blocks)};
  inferno::parallel_for(0, blocks, 4096, [&](int64_t begin, int64_t end) {  // prefill: 512 x 8960 in 0.3 ms, not 4.4
    for (int64_t b = begin; b < end; ++b) {
      const QuantizedBlock block = quantize_block(x + b * X_BLOCK, &q.codes[b * X_BLOCK]);
      q.scales[b] = block.scale;
      q.code_sums[b] = block.code_sum;
      q.sums[b] = block.sum;
    }
  });
  return q;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K / Q5_K's 12 bytes of 6-bit scales and mins of the 8 sub-blocks (as llama.cpp's get_scale_min_k4 reads them).
inline void k_scales(const uint8_t* p, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = p[j] & 0x3F;
    mn[j] = p[4 + j] & 0x3F;
    sc[4 + j] = (p[8 + j] & 0x0F) | ((p[j] >> 2) & 0x30);
    mn[4 + j] = (p[8 + j] >> 4) | ((p[4 + j] >> 2) & 0x30);
  }
}

// ---- the operators on K-quant super-blocks (256 weights in `block_bytes` bytes, rows [N, K / 256 * block_bytes]) ----
constexpr int64_t QK_K = 256;  // weights per super-block

// Super-blocks of each weight row per pass over the weights, for row blocks of `rows` rows of x taking
// `bytes_per_column` each: all of them while the row block fits L1 (it is read whole for every weight row; as at
// Qwen2.5-1.5B's K of 1536, and a decode step's one row: its weights then stream row after row), else chunks of about
// L1_X_BYTES of x, all of a thread's weight rows per chunk, so that x stays in L1 instead of streaming from L2 for
// each weight row (its down_proj's K of 8960: Q4_K at 32 rows, AVX-512, 131 against 104 GMAC/s). Each pass adds its
// partial sums to y (add_partial). The AVX-512 Q4_K and both Q6_K paths chunk; the AVX2 Q4_K path does not yet.
constexpr int64_t L1_X_BYTES = 32 << 10;

inline int64_t k_chunk(int64_t rows, int64_t k, int64_t bytes_per_column, int64_t span = QK_K) {
  const int64_t supers = k / span;  // (span: columns per super-block)
  if (rows * k * bytes_per_column <= L1_X_BYTES) return supers;
  return std::max<int64_t>(1, L1_X_BYTES / (rows * span * bytes_per_column));
}

#if defined(__AVX2__)
// The products of a block of 32 columns of a tile (4-bit codes, Q4_K and int4) per 32-bit lane: 4 codes of a weight
// row times 4 of x, summed over the block's 8 code vectors. With AVX-VNNI one instruction per vector. Without,
// maddubs adds pairs of products into 16 bits; the 8 vectors' pairs are summed there too (8 * 2 * 15 * 127 < 2^15)
// and widened once per block: 1.1 multiplies per vector, not 2.
struct NibbleDots {
  __m256i sums = _mm256_setzero_si256();
  void add(__m256i w, __m256i x) {
#if defined(__AVXVNNI__)
    sums = _mm256_dpbusd_avx_epi32(sums, w, x);
#else
    sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(w, x));
#endif
  }
  __m256i total() const {
#if defined(__AVXVNNI__)
    return sums;
#else
    return _mm256_madd_epi16(sums, _mm256_set1_epi16(1));
#endif
  }
};

// A 64-byte group of a tile's codes times R rows of x, added to dots[r][h]: its two 32-byte vectors (h = 0, 1) hold
// weight rows 8h .. 8h + 7, 4 columns each as low nibbles and the next 4 as high ones; row r's 8 columns of x are at
// x + r * x_stride. Each broadcast of 4 codes of x serves both halves (on Zen 5 a broadcast from memory costs about
// what a multiply does).
template <int64_t R>
inline void add_nibble_group(NibbleDots (&dots)[R][2], const uint8_t* codes, const int8_t* x, int64_t x_stride) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32));
  const __m256i low0 = _mm256_and_si256(v0, low4), high0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
  const __m256i low1 = _mm256_and_si256(v1, low4), high1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
  for (int64_t r = 0; r < R; ++r) {
    int32_t x_low, x_high;
    std::memcpy(&x_low, x + r * x_stride, 4);
    std::memcpy(&x_high, x + r * x_stride + 4, 4);
    const __m256i xl = _mm256_set1_epi32(x_low), xh = _mm256_set1_epi32(x_high);
    dots[r][0].add(low0, xl);
    dots[r][0].add(high0, xh);
    dots[r][1].add(low1, xl);
    dots[r][1].add(high1, xh);
    asm("" : "+x"(dots[r][0].sums), "+x"(dots[r][1].sums));  // GCC would hoist the multiplies and spill them
  }
}
#endif

inline void add_partial(float* y, float partial, bool first) { *y = first ? partial : *y + partial; }
#if defined(__AVX2__)
inline void add_partial(float* y, __m256 partial, bool first) {  // 8 outputs
  _mm256_storeu_ps(y, first ? partial : _mm256_add_ps(partial, _mm256_loadu_ps(y)));
}
#endif
#if defined(__AVX512F__)
inline void add_partial(float* y, __m512 partial, bool first) {  // 16 outputs
  _mm512_storeu_ps(y, first ? partial : _mm512_add_ps(partial, _mm512_loadu_ps(y)));
}
#endif

// x [M, K] float32 times the super-blocks [N, ...] -> y [M, N] float32: x quantized (quantize_rows), then
// matmul_rows(q, blocks, y, m, n, k), the kernel's sums.
template <typename MatmulRows>
void super_block_matmul(const inferno::View& x, const inferno::View& blocks, const inferno::View& y,
                        MatmulRows&& matmul_rows) {
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  if (m == 0 || n == 0) return;
  matmul_rows(quantize_rows(x.data_ptr<float>(), m, k), blocks.data_ptr<uint8_t>(), y.data_ptr<float>(), m, n, k);
}

// ---- tiles: TILE_ROWS weight rows regrouped so that a vector holds a few columns of each (q4_k_tile, q6_k_tile,
// int4_tile, q8_tile, q5_tile). A tile is a row of tile blocks, each holding `span` columns: a K-quant super-block
// (256) or a block of 32. ----
using inferno::TILE_ROWS;
constexpr int64_t TILE_GROUP = 4;  // tiles per pass over a row block of x: it stays in L1 across them
constexpr int64_t ROW_PANEL = 128;  // rows of x per pass over all of a thread's tiles

// The rows of x as the tile kernels read them: per block of `row_block` rows (the blocks tiles_matmul passes start at
// multiples of it; rows past M are zeros) and tile block of `span` columns, the rows' span codes one after another,
// likewise their span / 32 block scales and sums and (`with_starts`, Q6_K) minus 32 times the sum of each group of
// 16 codes. All that a row block reads at a tile block is then at constant offsets from one pointer each.
struct TileRows {
  int64_t row_block, supers;
  std::vector<int8_t> codes;        // [row blocks][supers][row_block][span]
  std::vector<float> scales, sums;  // [row blocks][supers][row_block][span / 32]
  std::vector<int32_t> starts;      // [row blocks][supers][row_block][span / 16]

  // The row-block-and-tile-block slot of row r0 (a multiple of row_block) at tile block s, counted in rows of one
  // tile block: codes start at span times it, scales and sums at span / 32 times it, starts at span / 16 times it.
  int64_t at(int64_t r0, int64_t s) const { return (r0 / row_block * supers + s) * row_block; }
};

// x [M, K] float32 quantized per block of 32 (quantize_block) straight into the TileRows layout.
inline TileRows tile_rows_of(const float* xf, int64_t m, int64_t k, int64_t row_block, bool with_starts, int64_t span) {
  const int64_t supers = k / span, padded = (m + row_block - 1) / row_block * row_block, blocks = span / X_BLOCK;
  TileRows x{row_block, supers, std::vector<int8_t>(padded * k), std::vector<float>(padded * k / X_BLOCK),
             std::vector<float>(padded * k / X_BLOCK), std::vector<int32_t>(with_starts ? padded * k / 16 : 0)};
  inferno::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t s = 0; s < supers; ++s) {
        const int64_t to = x.at(r - r % row_block, s) + r % row_block;
        int8_t* codes = &x.codes[to * span];
        for (int64_t i = 0; i < blocks; ++i) {
          const QuantizedBlock block = quantize_block(xf + r * k + s * span + X_BLOCK * i, codes + X_BLOCK * i);
          x.scales[to * blocks + i] = block.scale;
          x.sums[to * blocks + i] = block.sum;
        }
        for (int64_t g = 0; with_starts && g < span / 16; ++g) {
          int32_t sum = 0;
          for (int64_t i = 0; i < 16; ++i) sum += codes[16 * g + i];
          x.starts[to * (span / 16) + g] = -32 * sum;
        }
      }
  });
  return x;
}

// x [M, K] float32 times tiles [N / 16, K / span * tile_block_bytes] -> y [M, N] float32: x quantized and laid out
// as TileRows (with Q6_K's `with_starts`), then tile_rows(std::integral_constant<int64_t, R>{}, x, r, tile, y, n, s0,
// s1, first) for every row block [r, r + R) of x, tile and chunk of tile blocks [s0, s1) (k_chunk: the row block's
// codes stay in L1), the threads splitting the tiles; `y` is the tile's first output of row 0, and the chunks of a
// row block and tile come in order, `first` (s0 = 0) before the others, whose sums are added to it.
template <int64_t MAX_R, typename TileRowsKernel>
void tiles_matmul(const inferno::View& x, const inferno::View& tiles, const inferno::View& y, int64_t tile_block_bytes,
                  bool with_starts, TileRowsKernel&& tile_rows, int64_t span = QK_K) {
  const int64_t m = x.size(0), k = x.size(1), n = tiles.size(0) * TILE_ROWS;
  if (m == 0 || n == 0) return;
  const TileRows rows = tile_rows_of(x.data_ptr<float>(), m, k, MAX_R, with_starts, span);
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t supers = k / span, tile_bytes = supers * tile_block_bytes;
  // as for a whole row block whatever m: a row's sums then come in the same chunks, so the same bits, in any batch
  const int64_t chunk = k_chunk(MAX_R, k, 1, span);
  // A decode step's few rows stay in L1 whole: each tile is then read start to end, one stream the kernels'
  // prefetch runs ahead of (into the next tile at its end); tiles taking turns per chunk left the start of each
  // visit unprefetched (K = 8960 at one row, 2 Zen 5 cores: 54 -> 67-71 GB/s; K = 1536 reads 74).
  const int64_t group_size = m * k <= L1_X_BYTES / 2 ? 1 : TILE_GROUP;
  inferno::parallel_for(0, n / TILE_ROWS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = 0; panel < m; panel += ROW_PANEL)
      for (int64_t group = begin; group < end; group += group_size)
        for (int64_t s0 = 0; s0 < supers; s0 += chunk)
          for_row_blocks<MAX_R>(std::min(ROW_PANEL, m - panel), [&](auto block, int64_t r) {
            for (int64_t t = group; t < std::min(end, group + group_size); ++t)
              tile_rows(block, rows, panel + r, tp + t * tile_bytes, yp + t * TILE_ROWS, n, s0,
                        std::min(supers, s0 + chunk), s0 == 0);
          });
  });
}

// blocks [N, K / 256 * block_bytes] -> tiles [N / 16, K / 256 * tile_block_bytes]: tile_super_block(rows, out) for
// each super-block of each tile, rows[r] the block of its row r.
template <typename TileSuperBlock>
void tiled(const inferno::View& blocks, const inferno::View& tiles, int64_t block_bytes, int64_t tile_block_bytes,
           TileSuperBlock&& tile_super_block) {
  const int64_t n = blocks.size(0), supers = blocks.size(1) / block_bytes;
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  uint8_t* tp = tiles.data_ptr<uint8_t>();
  inferno::parallel_for(0, n / TILE_ROWS * supers, 64, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {  // u = tile * supers + super-block: the tiles' order
      const int64_t t = u / supers, s = u % supers;
      const uint8_t* rows[TILE_ROWS];
      for (int64_t r = 0; r < TILE_ROWS; ++r) rows[r] = bp + ((t * TILE_ROWS + r) * supers + s) * block_bytes;
      tile_super_block(rows, tp + u * tile_block_bytes);
    }
  });
}

// ---- the dequantizers' output, float32 or bfloat16 ----
inline uint16_t to_bfloat16(float x) {  // round to nearest even (weights are finite)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

inline void store(float* out, float w) { *out = w; }
inline void store(uint16_t* out, float w) { *out = to_bfloat16(w); }

// Runs fill(Out* w) with the data of `w`, float32 or bfloat16 (as its bits).
template <typename Fill>
void dequantized(const inferno::View& w, Fill&& fill) {
  if (w.scalar_type() == inferno::Dtype::Float) fill(w.data_ptr<float>());
  else fill(w.data_ptr<uint16_t>());
}

}  // namespace
