// GGUF Q4_K weights run as stored (4.5 bits per weight), registered in the `inferno` namespace like
// q6_k_gemv.cpp's operators:
// 1. `q4_k_matmul`: the few rows of a decode step, quantized to int8 per block of 32 (QuantizedRows), times the
//    weights' super-blocks, integer dot products per sub-block of 32;
// 2. `q4_k_dequantize`: to float32 or bfloat16, for the dense GEMM of prefill and large batches;
// 3. `q4_k_tile` and `q4_k_tiles_matmul`: the same super-blocks regrouped into tiles of 16 weight rows (see the
//    tiles' section below), which the model runner's warm-up makes, and the kernel that then runs every batch size.
//
// A row of K weights is K / 256 super-blocks of 144 bytes: d and dmin (float16), 12 bytes of 6-bit scales sc_j and
// mins m_j of its 8 sub-blocks of 32, then qs[128] (4-bit codes): sub-block 2i is the low nibbles of qs[32i ..
// 32i + 31], sub-block 2i + 1 their high nibbles; w = (d sc_j) q - (dmin m_j), q in [0, 15]. A sub-block is one
// block of x, so
//   sum_k w x = sum_j (d sc_j) xs_j sum_{k in j} q xq - sum_j (dmin m_j) (xs_j sum_{k in j} xq)
// with the integer sums exact and the second term on the rounded activations (QuantizedRows::sums), as the int4
// kernel computes Q4_K's groups, but with d sc_j and dmin m_j exact in float32 (11 by 6 significant bits) where the
// int4 layout rounds them to float16.
// Built once per ISA level (inferno/cpu_features.py): an AVX-512 VNNI path (64 weights, 2 sub-blocks per
// instruction), an AVX2 path (one sub-block per vector, AVX-VNNI where the compiler defines it) and plain loops for
// anything else.
#include "quantized_rows.h"

namespace {

constexpr int64_t BLOCK_BYTES = inferno::Q4K_BLOCK_BYTES;
constexpr int64_t SUB_BLOCKS = 8;  // of 32 weights: one block of x each

// The sub-block's 32 codes, in column order.
inline void sub_block_codes(const uint8_t* blk, int64_t j, uint8_t* codes) {
  const uint8_t* qs = blk + 16 + 32 * (j / 2);
  for (int64_t i = 0; i < 32; ++i) codes[i] = j % 2 ? qs[i] >> 4 : qs[i] & 0x0F;
}

#if defined(__AVX2__)
// k_scales' unpacking four sub-blocks at a time: bytes 0-3 of the result are sc_0..3, 4-7 sc_4..7, 8-11 m_0..3 and
// 12-15 m_4..7.
inline __m128i packed_scales_and_mins(const uint8_t* blk) {
  uint32_t u[3];
  std::memcpy(u, blk + 4, sizeof(u));
  const uint32_t low6 = 0x3F3F3F3F, low4 = 0x0F0F0F0F, bits45 = 0x30303030;
  return _mm_setr_epi32(static_cast<int>(u[0] & low6), static_cast<int>((u[2] & low4) | ((u[0] >> 2) & bits45)),
                        static_cast<int>(u[1] & low6),
                        static_cast<int>(((u[2] >> 4) & low4) | ((u[1] >> 2) & bits45)));
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t ROW_BLOCK = 8;  // rows of x per pass over the weights

// A 64-byte half of qs is two vectors of codes: its low nibbles (sub-blocks 4h and 4h + 2, 8 lanes each) and its
// high nibbles (4h + 1, 4h + 3). Vector t of a super-block covers sub-blocks VECTOR_SUB_BLOCKS[t].
constexpr int64_t VECTOR_SUB_BLOCKS[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};

struct KernelRows {  // the rows of x in the vectors' order, per row and super-block:
  std::vector<int8_t> codes;  // [M, K]: the blocks of x as the vectors pair them (0 2 1 3 4 6 5 7)
  std::vector<float> lane_scales;  // [M, K / 4]: per lane of those vectors the xs of its block
};

KernelRows kernel_rows(const QuantizedRows& q, int64_t m, int64_t k) {
  KernelRows x{std::vector<int8_t>(m * k), std::vector<float>(m * k / 4)};
  for (int64_t s = 0; s < m * k / QK_K; ++s)
    for (int64_t t = 0; t < 4; ++t)
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t b = s * SUB_BLOCKS + VECTOR_SUB_BLOCKS[t][half], at = s * QK_K + 64 * t + 32 * half;
        std::memcpy(&x.codes[at], &q.codes[b * X_BLOCK], X_BLOCK);
        std::fill_n(&x.lane_scales[at / 4], 8, q.scales[b]);
      }
  return x;
}

// Output rows [begin, end) for R rows of x (from row r0), super-blocks [s0, s1) of each weight row: the partial sums
// are added to y unless `first`. Per super-block the scales d sc_j and mins dmin m_j are converted at once (a vector
// of 16) and spread to the vectors' lanes by permutations; per row of x, a VNNI instruction and one float
// multiply-add per vector, and the mins' term on 8 lanes.
template <int64_t R>
void q4_k_rows(const KernelRows& x, const QuantizedRows& q, int64_t r0, const uint8_t* blocks, float* y, int64_t n,
               int64_t k, int64_t begin, int64_t end, int64_t s0, int64_t s1, bool first) {
  const int64_t supers = k / QK_K, row_bytes = supers * BLOCK_BYTES;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i d_or_dmin = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512i spread[4];  // vector t's lanes: the scale of sub-block VECTOR_SUB_BLOCKS[t][lane / 8]
  for (int64_t t = 0; t < 4; ++t)
    spread[t] = _mm512_inserti64x4(_mm512_set1_epi32(static_cast<int>(VECTOR_SUB_BLOCKS[t][0])),
                                   _mm256_set1_epi32(static_cast<int>(VECTOR_SUB_BLOCKS[t][1])), 1);
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = blocks + j * row_bytes;
    prefetch_ahead(row + s0 * BLOCK_BYTES, (s1 - s0) * BLOCK_BYTES);
    __m512 acc[R];
    __m256 min_acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), min_acc[r] = _mm256_setzero_ps();
    for (int64_t s = s0; s < s1; ++s) {
      const uint8_t* blk = row + s * BLOCK_BYTES;
      int32_t d_dmin;
      std::memcpy(&d_dmin, blk, sizeof(d_dmin));
      const __m512 factors = _mm512_permutexvar_ps(d_or_dmin, _mm512_cvtph_ps(_mm256_set1_epi32(d_dmin)));
      // lanes 0-7: d sc_j, lanes 8-15: dmin m_j
      const __m512 scales = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(packed_scales_and_mins(blk))),
                                          factors);
      const __m256 mins = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(scales), 1));
      const __m512i qs0 = _mm512_loadu_si512(blk + 16), qs1 = _mm512_loadu_si512(blk + 80);
      const __m512i w[4] = {_mm512_and_si512(qs0, low4), _mm512_and_si512(_mm512_srli_epi16(qs0, 4), low4),
                            _mm512_and_si512(qs1, low4), _mm512_and_si512(_mm512_srli_epi16(qs1, 4), low4)};
      __m512 w_scales[4];
      for (int64_t t = 0; t < 4; ++t) w_scales[t] = _mm512_permutexvar_ps(spread[t], scales);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * k + s * QK_K;
        const int8_t* xc = x.codes.data() + at;
        const float* xs = x.lane_scales.data() + at / 4;
#pragma GCC unroll 4
        for (int64_t t = 0; t < 4; ++t) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[t], _mm512_loadu_si512(xc + 64 * t));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(xs + 16 * t)), w_scales[t],
                                   acc[r]);
        }
        min_acc[r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(q.sums.data() + at / X_BLOCK), min_acc[r]);
      }
    }
    for (int64_t r = 0; r < R; ++r)
      add_partial(y + r * n + j, _mm512_reduce_add_ps(acc[r]) - sum_lanes256(min_acc[r]), first);
  }
}

void q4_k_matmul_rows(const QuantizedRows& q, const uint8_t* blocks, float* y, int64_t m, int64_t n, int64_t k) {
  const KernelRows x = kernel_rows(q, m, k);
  const int64_t supers = k / QK_K;
  inferno::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for_row_blocks<ROW_BLOCK>(m, [&](auto rows, int64_t r) {
      const int64_t chunk = k_chunk(decltype(rows)::value, k, 2);  // x: codes and lane scales
      for (int64_t s0 = 0; s0 < supers; s0 += chunk)
        q4_k_rows<decltype(rows)::value>(x, q, r, blocks, y + r * n, n, k, begin, end, s0,
                                         std::min(supers, s0 + chunk), s0 == 0);
    });
  });
}
#elif defined(__AVX2__)
constexpr int64_t ROW_BLOCK = AVX2_ROW_BLOCK;

// sum of 4 products per int32 lane of unsigned 4-bit codes w and signed int8 x
inline __m256i lane_dots(__m256i w, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else  // pairs of products fit 16 bits: 2 * 15 * 127 < 2^15
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

// The lane sums of 8 vectors, one per sub-block, as one vector of 8 (sub-block order).
inline __m256i sub_block_sums(const __m256i (&d)[SUB_BLOCKS]) {
  const __m256i low = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
  const __m256i high = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20), _mm256_permute2x128_si256(low, high, 0x31));
}

// A vector of 32 codes per sub-block (x in column order, no preparation); per row of x and super-block the 8
// integer sums are gathered into one vector for a single float multiply-add, the mins' term into another.
template <int64_t R>
void q4_k_rows(const QuantizedRows& q, int64_t r0, const uint8_t* blocks, float* y, int64_t n, int64_t k,
               int64_t begin, int64_t end) {
  const int64_t supers = k / QK_K, row_bytes = supers * BLOCK_BYTES;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = blocks + j * row_bytes;
    prefetch_ahead(row, row_bytes);
    __m256 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < supers; ++s) {
      const uint8_t* blk = row + s * BLOCK_BYTES;
      const __m128i packed = packed_scales_and_mins(blk);
      const __m256 w_scales = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed)),
                                            _mm256_set1_ps(half_at(blk)));
      const __m256 w_mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8))),
                                          _mm256_set1_ps(half_at(blk + 2)));
      __m256i w[SUB_BLOCKS];
      for (int64_t i = 0; i < 4; ++i) {
        const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * i));
        w[2 * i] = _mm256_and_si256(qs, low4);
        w[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(qs, 4), low4);
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * k + s * QK_K;
        __m256i dots[SUB_BLOCKS];
        for (int64_t b = 0; b < SUB_BLOCKS; ++b)
          dots[b] = lane_dots(w[b], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.codes.data() + at + 32 * b)));
        const __m256 xs = _mm256_loadu_ps(q.scales.data() + at / X_BLOCK);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sub_block_sums(dots)), _mm256_mul_ps(w_scales, xs), acc[r]);
        acc[r] = _mm256_fnmadd_ps(w_mins, _mm256_loadu_ps(q.sums.data() + at / X_BLOCK), acc[r]);
      }
    }
    for (int64_t r = 0; r < R; ++r) y[r * n + j] = sum_lanes256(acc[r]);
  }
}

void q4_k_matmul_rows(const QuantizedRows& q, const uint8_t* blocks, float* y, int64_t m, int64_t n, int64_t k) {
  inferno::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for_row_blocks<ROW_BLOCK>(m, [&](auto rows, int64_t r) {
      q4_k_rows<decltype(rows)::value>(q, r, blocks, y + r * n, n, k, begin, end);
    });
  });
}
#else  // the same sums, left to the compiler
void q4_k_matmul_rows(const QuantizedRows& q, const uint8_t* blocks, float* y, int64_t m, int64_t n, int64_t k) {
  const int64_t supers = k / QK_K, row_bytes = supers * BLOCK_BYTES;
  inferno::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    uint8_t codes[X_BLOCK], sc[SUB_BLOCKS], mn[SUB_BLOCKS];
    std::vector<float> acc(m);
    for (int64_t j = begin; j < end; ++j) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* blk = blocks + j * row_bytes + s * BLOCK_BYTES;
        k_scales(blk + 4, sc, mn);
        const float d = half_at(blk), dmin = half_at(blk + 2);
        for (int64_t b = 0; b < SUB_BLOCKS; ++b) {
          sub_block_codes(blk, b, codes);
          const float scale = d * static_cast<float>(sc[b]), min = dmin * static_cast<float>(mn[b]);
          for (int64_t r = 0; r < m; ++r) {
            const int64_t xb = (r * k + s * QK_K) / X_BLOCK + b;
            int32_t dot = 0;
            for (int64_t i = 0; i < X_BLOCK; ++i) dot += int32_t{codes[i]} * int32_t{q.codes[xb * X_BLOCK + i]};
            acc[r] += static_cast<float>(dot) * scale * q.scales[xb] - min * q.sums[xb];
          }
        }
      }
      for (int64_t r = 0; r < m; ++r) y[r * n + j] = acc[r];
    }
  });
}
#endif

}  // namespace

namespace inferno::cpu {

void q4_k_matmul(const View& x, const View& blocks, const View& y) {
  super_block_matmul(x, blocks, y, q4_k_matmul_rows);
}

// blocks [N, K / 256 * 144] uint8 -> W [N, K], w = (d * sc) * q - (dmin * m) in float32 (as gguf.quants.dequantize
// computes it), rounded once to `dtype`
void q4_k_dequantize(const View& blocks, const View& w) {
  const int64_t n = blocks.size(0), supers = blocks.size(1) / BLOCK_BYTES, k = supers * QK_K;
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  dequantized(w, [&](auto* wp) {
    inferno::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      uint8_t codes[X_BLOCK], sc[SUB_BLOCKS], mn[SUB_BLOCKS];
      for (int64_t j = begin; j < end; ++j)
        for (int64_t s = 0; s < supers; ++s) {
          const uint8_t* blk = bp + (j * supers + s) * BLOCK_BYTES;
          k_scales(blk + 4, sc, mn);
          const float d = half_at(blk), dmin = half_at(blk + 2);
          for (int64_t b = 0; b < SUB_BLOCKS; ++b) {
            sub_block_codes(blk, b, codes);
            const float scale = d * static_cast<float>(sc[b]), min = dmin * static_cast<float>(mn[b]);
            auto* out = wp + j * k + s * QK_K + b * X_BLOCK;
#pragma omp simd
            for (int64_t i = 0; i < X_BLOCK; ++i) store(out + i, scale * static_cast<float>(codes[i]) - min);
          }
        }
    });
  });
}

}  // namespace inferno::cpu

namespace {

// ---- tiles: the same super-blocks regrouped, losslessly, for kernels that put weight rows in vector lanes ----
// A tile is TILE_ROWS consecutive weight rows. Per super-block of a tile, TILE_BLOCK_BYTES bytes: d[16] and dmin[16]
// (float16, as stored), sc[8][16] and m[8][16] (the 6-bit scales and mins unpacked to a byte each), then the codes in
// 32 groups of 8 columns: byte 4 r + c of group g holds row r's codes of columns 8 g + c (low nibble) and 8 g + 4 + c
// (high nibble), c < 4. The 64 low (high) nibbles of a group are then 16 rows' 4 consecutive codes, one int32 lane
// per weight row: one VNNI instruction with 4 codes of a row of x broadcast adds 4 products to each of 16 outputs
// (no horizontal sums, one load of codes for every row of x), and the scales and mins of a sub-block are a vector.
// Every value of the stored blocks is kept: 4.625 bits per weight instead of 4.5.
constexpr int64_t TILE_BLOCK_BYTES = inferno::Q4K_TILE_BLOCK_BYTES;
constexpr int64_t TILE_SCALES = 64, TILE_MINS = 192, TILE_CODES = 320;  // byte offsets in a tile's super-block

// The 16 rows' super-blocks `rows[r]` as one tile super-block at `out`.
void tile_super_block(const uint8_t* const* rows, uint8_t* out) {
  for (int64_t r = 0; r < TILE_ROWS; ++r) {
    const uint8_t* blk = rows[r];
    std::memcpy(out + 2 * r, blk, 2);
    std::memcpy(out + 2 * TILE_ROWS + 2 * r, blk + 2, 2);
    uint8_t sc[SUB_BLOCKS], mn[SUB_BLOCKS], codes[QK_K];
    k_scales(blk + 4, sc, mn);
    for (int64_t j = 0; j < SUB_BLOCKS; ++j) {
      out[TILE_SCALES + TILE_ROWS * j + r] = sc[j];
      out[TILE_MINS + TILE_ROWS * j + r] = mn[j];
      sub_block_codes(blk, j, codes + X_BLOCK * j);
    }
    for (int64_t g = 0; g < QK_K / 8; ++g)
      for (int64_t c = 0; c < 4; ++c)
        out[TILE_CODES + 64 * g + 4 * r + c] = static_cast<uint8_t>(codes[8 * g + c] | (codes[8 * g + 4 + c] << 4));
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t TILE_ROW_BLOCK = 8;  // rows of x per pass: 8 integer and 8 float accumulators

// One tile's 16 outputs for R rows of x (from row r0), super-blocks [s0, s1): per sub-block and row of x, 8 VNNI
// instructions into an integer vector, then one float multiply-add with d sc_j times the block's xs, one with
// dmin m_j times the block's sum. The results are added to y unless `first`.
template <int64_t R>
void tile_rows(const TileRows& x, int64_t r0, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
               bool first) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = tile + s * TILE_BLOCK_BYTES;
    const int64_t at = x.at(r0, s);
    const int8_t* xc = x.codes.data() + at * QK_K;  // row r's codes at xc + r * QK_K
    const float *xs = x.scales.data() + at * SUB_BLOCKS, *xm = x.sums.data() + at * SUB_BLOCKS;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2 * TILE_ROWS)));
    for (int64_t j = 0; j < SUB_BLOCKS; ++j) {
      const uint8_t* next = b + 2 * TILE_BLOCK_BYTES + 320 * j;  // a decode step streams the weights: 2 KB ahead
      for (int64_t line = 0; line < 320; line += 64) _mm_prefetch(reinterpret_cast<const char*>(next + line), _MM_HINT_T0);
      const __m512 ws = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + TILE_SCALES + TILE_ROWS * j)))));
      const __m512 wm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + TILE_MINS + TILE_ROWS * j)))));
      __m512i dots[R];
      for (int64_t r = 0; r < R; ++r) dots[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int64_t g = 4 * j; g < 4 * j + 4; ++g) {
        const __m512i codes = _mm512_loadu_si512(b + TILE_CODES + 64 * g);
        const __m512i low = _mm512_and_si512(codes, low4), high = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low4);
        for (int64_t r = 0; r < R; ++r) {
          const int8_t* xg = xc + r * QK_K + 8 * g;
          int32_t x_low, x_high;
          std::memcpy(&x_low, xg, 4);
          std::memcpy(&x_high, xg + 4, 4);
          dots[r] = _mm512_dpbusd_epi32(dots[r], low, _mm512_set1_epi32(x_low));
          dots[r] = _mm512_dpbusd_epi32(dots[r], high, _mm512_set1_epi32(x_high));
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_mul_ps(ws, _mm512_set1_ps(xs[SUB_BLOCKS * r + j])),
                                 acc[r]);
        acc[r] = _mm512_fnmadd_ps(wm, _mm512_set1_ps(xm[SUB_BLOCKS * r + j]), acc[r]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) add_partial(y + (r0 + r) * n, acc[r], first);
}
#elif defined(__AVX2__)
constexpr int64_t TILE_ROW_BLOCK = 4;

inline __m256 bytes_as_floats(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// tile_rows of the AVX-512 path with each vector of 16 lanes as two halves of 8 (h = 0, 1), both halves per group of
// codes (add_nibble_group)
template <int64_t R>
void tile_rows(const TileRows& x, int64_t r0, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
               bool first) {
  __m256 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = tile + s * TILE_BLOCK_BYTES;
    const int64_t at = x.at(r0, s);
    const int8_t* xc = x.codes.data() + at * QK_K;
    const float *xs = x.scales.data() + at * SUB_BLOCKS, *xm = x.sums.data() + at * SUB_BLOCKS;
    __m256 d[2], dmin[2];
    for (int64_t h = 0; h < 2; ++h) {
      d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * h)));
      dmin[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * TILE_ROWS + 16 * h)));
    }
    for (int64_t j = 0; j < SUB_BLOCKS; ++j) {
      const uint8_t* next = b + 2 * TILE_BLOCK_BYTES + 320 * j;  // a decode step streams the weights: 2 KB ahead
      for (int64_t line = 0; line < 320; line += 64) _mm_prefetch(reinterpret_cast<const char*>(next + line), _MM_HINT_T0);
      NibbleDots dots[R][2];
      for (int64_t g = 0; g < 4; ++g) add_nibble_group(dots, b + TILE_CODES + 64 * (4 * j + g), xc + 8 * (4 * j + g), QK_K);
      for (int64_t h = 0; h < 2; ++h) {
        const __m256 ws = _mm256_mul_ps(d[h], bytes_as_floats(b + TILE_SCALES + TILE_ROWS * j + 8 * h));
        const __m256 wm = _mm256_mul_ps(dmin[h], bytes_as_floats(b + TILE_MINS + TILE_ROWS * j + 8 * h));
        for (int64_t r = 0; r < R; ++r) {
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r][h].total()),
                                      _mm256_mul_ps(ws, _mm256_set1_ps(xs[SUB_BLOCKS * r + j])), acc[r][h]);
          acc[r][h] = _mm256_fnmadd_ps(wm, _mm256_set1_ps(xm[SUB_BLOCKS * r + j]), acc[r][h]);
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < 2; ++h) add_partial(y + (r0 + r) * n + 8 * h, acc[r][h], first);
}
#else
constexpr int64_t TILE_ROW_BLOCK = 1;

template <int64_t R>
void tile_rows(const TileRows& x, int64_t r0, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
               bool first) {
  static_assert(R == 1);
  float acc[TILE_ROWS] = {};
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = tile + s * TILE_BLOCK_BYTES;
    const int64_t at = x.at(r0, s);
    const int8_t* xc = x.codes.data() + at * QK_K;
    for (int64_t j = 0; j < SUB_BLOCKS; ++j) {
      int32_t dots[TILE_ROWS] = {};
      for (int64_t g = 4 * j; g < 4 * j + 4; ++g)
        for (int64_t lane = 0; lane < 64; ++lane) {
          const int64_t column = 8 * g + lane % 4, row = lane / 4;
          const uint8_t codes = b[TILE_CODES + 64 * g + lane];
          dots[row] += int32_t{codes & 0x0F} * xc[column] + int32_t{codes >> 4} * xc[column + 4];
        }
      const int64_t xb = at * SUB_BLOCKS + j;
      for (int64_t row = 0; row < TILE_ROWS; ++row) {
        const float scale = half_at(b + 2 * row) * static_cast<float>(b[TILE_SCALES + TILE_ROWS * j + row]);
        const float min = half_at(b + 2 * TILE_ROWS + 2 * row) * static_cast<float>(b[TILE_MINS + TILE_ROWS * j + row]);
        acc[row] += static_cast<float>(dots[row]) * (scale * x.scales[xb]) - min * x.sums[xb];
      }
    }
  }
  for (int64_t row = 0; row < TILE_ROWS; ++row) add_partial(y + r0 * n + row, acc[row], first);
}
#endif

}  // namespace

namespace inferno::cpu {

void q4_k_tile(const View& blocks, const View& tiles) {
  tiled(blocks, tiles, BLOCK_BYTES, TILE_BLOCK_BYTES, tile_super_block);
}

void q4_k_tiles_matmul(const View& x, const View& tiles, const View& y) {
  tiles_matmul<TILE_ROW_BLOCK>(x, tiles, y, TILE_BLOCK_BYTES, false,
                               [](auto rows, const TileRows& rx, int64_t r, const uint8_t* tile, float* y,
                                  int64_t n, int64_t s0, int64_t s1, bool first) {
    tile_rows<decltype(rows)::value>(rx, r, tile, y, n, s0, s1, first);
  });
}

}  // namespace inferno::cpu
