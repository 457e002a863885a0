// GGUF Q6_K weights run as stored (6.5625 bits per weight), registered in the `inferno` namespace like
// quantized_gemv.cpp's operators:
// 1. `q6_k_matmul`: the few rows of a decode step, quantized to int8 per block of 32 (QuantizedRows), times the
//    weights' super-blocks, integer dot products as llama.cpp computes Q6_K x Q8;
// 2. `q6_k_dequantize`: to float32 or bfloat16, for the dense GEMM of prefill and large batches (AVX-512: the
//    matmul's codes, a group of 16 per vector; 1536 x 8960 to bfloat16 in 0.9 ms, 16.6 with the scalar loop);
// 3. `q6_k_tile` and `q6_k_tiles_matmul`: the same super-blocks regrouped into tiles of 16 weight rows (see the
//    tiles' section below), which the model runner's warm-up makes, and the kernel that then runs every batch size.
//
// A row of K weights is K / 256 super-blocks of 210 bytes: ql[128] (4 low bits), qh[64] (2 high bits), sc[16]
// (int8, one per group of 16) and d (float16); w = d * sc_g * (q - 32), q in [0, 63]. Half h of a super-block
// holds its weights 128h .. 128h + 127: weight 128h + 32v + j (v < 4, j < 32) is the low (v < 2) or high (v >= 2)
// nibble of ql[64h + 32 (v % 2) + j] under bits 2v and 2v + 1 of qh[32h + j].
//   sum_k w x = sum_b xs_b * sum_{g in b} (d sc_g) * sum_{k in g} (q - 32) xq
// The integer sums take the unsigned q times the signed xq, 4 products per int32 lane (a lane stays in its group
// of 16), and drop the offset before any rounding: each lane starts at -32 times the sum of its 4 xq. One float
// multiply-add per lane then applies d sc_g xs_b (d sc_g is exact in float32: 11 by 8 significant bits).
// Built once per ISA level (inferno/cpu_features.py): an AVX-512 VNNI path (64 weights per instruction), an AVX2
// path (32, AVX-VNNI where the compiler defines it) and plain loops for anything else.
#include "float_vectors.h"
#include "quantized_rows.h"

namespace {

constexpr int64_t BLOCK_BYTES = inferno::Q6K_BLOCK_BYTES;
constexpr int64_t LANE_CODES = 4;  // codes of x per int32 lane of the dot products

// The super-block's 256 codes q - 32, in column order.
inline void block_codes(const uint8_t* blk, int8_t* codes) {
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t v = 0; v < 4; ++v)
      for (int64_t j = 0; j < 32; ++j) {
        const int low = (blk[64 * h + 32 * (v % 2) + j] >> (4 * (v / 2))) & 0x0F;
        const int high = (blk[128 + 32 * h + j] >> (2 * v)) & 3;
        codes[128 * h + 32 * v + j] = static_cast<int8_t>((low | high << 4) - 32);
      }
}

#if defined(__AVX2__)
struct LaneRows {  // per row of x and lane of 4 codes: the lane's accumulator start and its block's xs
  std::vector<int32_t> starts;  // [M, K / 4]: -32 * the sum of the lane's codes
  std::vector<float> scales;    // [M, K / 4]
};

LaneRows lane_rows(const QuantizedRows& q, int64_t m, int64_t k) {
  const int64_t lanes = m * k / LANE_CODES;
  LaneRows x{std::vector<int32_t>(lanes), std::vector<float>(lanes)};
  for (int64_t l = 0; l < lanes; ++l) {
    const int8_t* c = q.codes.data() + l * LANE_CODES;
    x.starts[l] = -32 * (c[0] + c[1] + c[2] + c[3]);
    x.scales[l] = q.scales[l * LANE_CODES / X_BLOCK];
  }
  return x;
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t ROW_BLOCK = 8;  // rows of x per pass over the weights

// A half super-block (ql: its 64 bytes of ql; qh: its 32 bytes of qh in both halves of the vector) is two vectors
// of 64 codes: the low nibbles of ql under qh's bits 0-1 (first 32 bytes) or 2-3 (next 32), and the high nibbles
// under bits 4-5 or 6-7.
struct HighBits {  // qh's bits moved to 4-5 by 16-bit shifts, per half of the vector
  __m512i low_nibbles = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);  // qh << 4, << 2
  __m512i high_nibbles = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);  // qh, qh >> 2
};

inline __m512i low_codes(__m512i ql, __m512i qh, const HighBits& shift) {
  return _mm512_or_si512(_mm512_and_si512(ql, _mm512_set1_epi8(0x0F)),
                         _mm512_and_si512(_mm512_sllv_epi16(qh, shift.low_nibbles), _mm512_set1_epi8(0x30)));
}

inline __m512i high_codes(__m512i ql, __m512i qh, const HighBits& shift) {
  return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), _mm512_set1_epi8(0x0F)),
                         _mm512_and_si512(_mm512_srlv_epi16(qh, shift.high_nibbles), _mm512_set1_epi8(0x30)));
}

inline void store_group(float* out, __m512 w) { _mm512_storeu_ps(out, w); }

inline void store_group(uint16_t* out, __m512 w) {  // bfloat16 bits, rounded to nearest even
  const ushortv bits = to_bfloat16(static_cast<floatv>(w));
  std::memcpy(out, &bits, sizeof(bits));
}

// The super-block's 256 weights (d sc_g) (q - 32), a group of 16 per vector: the products the scalar dequantizer
// computes, in the same order (bit-exact).
template <typename Out>
inline void dequantize_block(const uint8_t* blk, Out* out, const HighBits& shift) {
  const __m512i ql0 = _mm512_loadu_si512(blk), ql1 = _mm512_loadu_si512(blk + 64);
  const __m512i qh0 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128)));
  const __m512i qh1 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 160)));
  const __m512i w[4] = {low_codes(ql0, qh0, shift), high_codes(ql0, qh0, shift), low_codes(ql1, qh1, shift),
                        high_codes(ql1, qh1, shift)};
  const float d = half_at(blk + 208);
  for (int64_t t = 0; t < 4; ++t) {  // vector t: columns 64t .. 64t + 63, groups 4t .. 4t + 3
    const __m512i centred = _mm512_sub_epi8(w[t], _mm512_set1_epi8(32));
    const __m128i groups[4] = {_mm512_castsi512_si128(centred), _mm512_extracti32x4_epi32(centred, 1),
                               _mm512_extracti32x4_epi32(centred, 2), _mm512_extracti32x4_epi32(centred, 3)};
    for (int64_t q = 0; q < 4; ++q) {
      const int64_t g = 4 * t + q;
      const float scale = d * static_cast<float>(static_cast<int8_t>(blk[192 + g]));
      const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(groups[q]));
      store_group(out + 16 * g, _mm512_mul_ps(_mm512_set1_ps(scale), codes));
    }
  }
}

// Output rows [begin, end) for R rows of x (xq, starts, x_scales: from the first of them on). Vector v of a
// super-block covers its columns 64v .. 64v + 63: groups 4v .. 4v + 3 (4 lanes each) and two blocks of x (8 lanes
// each).
template <int64_t R>
void q6_k_rows(const int8_t* xq, const int32_t* starts, const float* x_scales, const uint8_t* blocks, float* y,
               int64_t n, int64_t k, int64_t begin, int64_t end, int64_t s0, int64_t s1, bool first) {
  const int64_t supers = k / QK_K, row_bytes = supers * BLOCK_BYTES, lanes = k / LANE_CODES;
  const HighBits shift;
  const __m512i lane_group =  // lane l: group l / 4
      _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
  const __m512i groups[4] = {lane_group, _mm512_add_epi32(lane_group, _mm512_set1_epi32(4)),
                             _mm512_add_epi32(lane_group, _mm512_set1_epi32(8)),
                             _mm512_add_epi32(lane_group, _mm512_set1_epi32(12))};
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = blocks + j * row_bytes;
    prefetch_ahead(row + s0 * BLOCK_BYTES, (s1 - s0) * BLOCK_BYTES);
    __m512 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t s = s0; s < s1; ++s) {
      const uint8_t* blk = row + s * BLOCK_BYTES;
      const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      const __m512 group_scales = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), _mm512_set1_ps(half_at(blk + 208)));
      const __m512i ql0 = _mm512_loadu_si512(blk), ql1 = _mm512_loadu_si512(blk + 64);
      const __m512i qh0 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128)));
      const __m512i qh1 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 160)));
      const __m512i w[4] = {low_codes(ql0, qh0, shift), high_codes(ql0, qh0, shift), low_codes(ql1, qh1, shift),
                            high_codes(ql1, qh1, shift)};
#pragma GCC unroll 4
      for (int64_t v = 0; v < 4; ++v) {
        const __m512 w_scale = _mm512_permutexvar_ps(groups[v], group_scales);
        const int64_t lane = 16 * (4 * s + v);
        for (int64_t r = 0; r < R; ++r) {
          const __m512i x = _mm512_loadu_si512(xq + r * k + 4 * lane);
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(starts + r * lanes + lane), w[v], x);
          const __m512 scale = _mm512_mul_ps(w_scale, _mm512_loadu_ps(x_scales + r * lanes + lane));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) add_partial(y + r * n + j, _mm512_reduce_add_ps(acc[r]), first);
  }
}
#elif defined(__AVX2__)
constexpr int64_t ROW_BLOCK = AVX2_ROW_BLOCK;

// sum of 4 products per int32 lane of unsigned 6-bit codes w and signed int8 x, added to `start`
inline __m256i lane_dots(__m256i start, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(start, w, x);
#else  // pairs of products fit 16 bits: 2 * 63 * 127 < 2^15
  return _mm256_add_epi32(start, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

// The sums of the AVX-512 kernel above, in vectors of 32 codes: block b of a row covers columns 32b .. 32b + 31,
// groups 2b, 2b + 1 (4 lanes each); a half super-block is 4 of them.
template <int64_t R>
void q6_k_rows(const int8_t* xq, const int32_t* starts, const float* x_scales, const uint8_t* blocks, float* y,
               int64_t n, int64_t k, int64_t begin, int64_t end, int64_t s0, int64_t s1, bool first) {
  const int64_t supers = k / QK_K, row_bytes = supers * BLOCK_BYTES, lanes = k / LANE_CODES;
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  const __m256i lane_group = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = blocks + j * row_bytes;
    prefetch_ahead(row + s0 * BLOCK_BYTES, (s1 - s0) * BLOCK_BYTES);
    __m256 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t s = s0; s < s1; ++s) {
      const uint8_t* blk = row + s * BLOCK_BYTES;
      const __m256 d = _mm256_set1_ps(half_at(blk + 208));
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
      const __m256 group_scales[2] = {  // groups 0-7, 8-15
          _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d),
          _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d)};
#pragma GCC unroll 2
      for (int64_t h = 0; h < 2; ++h) {
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        const __m256i w[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45)),
            _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, bits45)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45))};
#pragma GCC unroll 4
        for (int64_t v = 0; v < 4; ++v) {
          const int64_t b = 8 * s + 4 * h + v;
          const __m256 w_scale =
              _mm256_permutevar8x32_ps(group_scales[h], _mm256_add_epi32(lane_group, _mm256_set1_epi32(2 * v)));
          for (int64_t r = 0; r < R; ++r) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * k + 32 * b));
            const __m256i start = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(starts + r * lanes + 8 * b));
            const __m256 scale = _mm256_mul_ps(w_scale, _mm256_loadu_ps(x_scales + r * lanes + 8 * b));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lane_dots(start, w[v], x)), scale, acc[r]);
          }
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) add_partial(y + r * n + j, sum_lanes256(acc[r]), first);
  }
}
#endif

#if defined(__AVX2__)
void q6_k_matmul_rows(const QuantizedRows& q, const uint8_t* blocks, float* y, int64_t m, int64_t n, int64_t k) {
  const LaneRows x = lane_rows(q, m, k);
  const int64_t lanes = k / LANE_CODES;
  const int64_t supers = k / QK_K;
  inferno::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for_row_blocks<ROW_BLOCK>(m, [&](auto rows, int64_t r) {
      const int64_t chunk = k_chunk(decltype(rows)::value, k, 3);  // x: codes, starts and scales
      for (int64_t s0 = 0; s0 < supers; s0 += chunk)
        q6_k_rows<decltype(rows)::value>(q.codes.data() + r * k, x.starts.data() + r * lanes,
                                         x.scales.data() + r * lanes, blocks, y + r * n, n, k, begin, end, s0,
                                         std::min(supers, s0 + chunk), s0 == 0);
    });
  });
}
#else  // the same sums, left to the compiler
void q6_k_matmul_rows(const QuantizedRows& q, const uint8_t* blocks, float* y, int64_t m, int64_t n, int64_t k) {
  const int64_t supers = k / QK_K, row_bytes = supers * BLOCK_BYTES;
  inferno::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    int8_t codes[QK_K];
    std::vector<float> acc(m);
    for (int64_t j = begin; j < end; ++j) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* blk = blocks + j * row_bytes + s * BLOCK_BYTES;
        block_codes(blk, codes);
        const float d = half_at(blk + 208);
        for (int64_t g = 0; g < QK_K / 16; ++g) {
          const float scale = d * static_cast<float>(static_cast<int8_t>(blk[192 + g]));
          for (int64_t r = 0; r < m; ++r) {
            const int64_t first = r * k + s * QK_K + 16 * g;
            int32_t dot = 0;
            for (int64_t i = 0; i < 16; ++i) dot += int32_t{codes[16 * g + i]} * int32_t{q.codes[first + i]};
            acc[r] += static_cast<float>(dot) * scale * q.scales[first / X_BLOCK];
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

void q6_k_matmul(const View& x, const View& blocks, const View& y) {
  super_block_matmul(x, blocks, y, q6_k_matmul_rows);
}

// blocks [N, K / 256 * 210] uint8 -> W [N, K], w = (d * sc) * (q - 32) in float32 (as gguf.quants.dequantize
// computes it), rounded once to `dtype`
void q6_k_dequantize(const View& blocks, const View& w) {
  const int64_t n = blocks.size(0), supers = blocks.size(1) / BLOCK_BYTES, k = supers * QK_K;
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  dequantized(w, [&](auto* wp) {
    inferno::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      const HighBits shift;
      for (int64_t j = begin; j < end; ++j)
        for (int64_t s = 0; s < supers; ++s)
          dequantize_block(bp + (j * supers + s) * BLOCK_BYTES, wp + j * k + s * QK_K, shift);
#else
      int8_t codes[QK_K];
      for (int64_t j = begin; j < end; ++j)
        for (int64_t s = 0; s < supers; ++s) {
          const uint8_t* blk = bp + (j * supers + s) * BLOCK_BYTES;
          block_codes(blk, codes);
          const float d = half_at(blk + 208);
          auto* out = wp + j * k + s * QK_K;
          for (int64_t g = 0; g < QK_K / 16; ++g) {
            const float scale = d * static_cast<float>(static_cast<int8_t>(blk[192 + g]));
#pragma omp simd
            for (int64_t i = 16 * g; i < 16 * (g + 1); ++i) store(out + i, scale * static_cast<float>(codes[i]));
          }
        }
#endif
    });
  });
}

}  // namespace inferno::cpu

namespace {

// ---- tiles: the same super-blocks regrouped, losslessly, with weight rows in vector lanes (as q4_k_tile's) ----
// Per super-block of a tile of TILE_ROWS rows, TILE_BLOCK_BYTES bytes: d[16] (float16), sc[16][16] (group g's
// int8 scale of row r at 16 g + r), then the codes' 4 low bits as the Q4_K tiles hold theirs (32 groups of 8
// columns, 64 bytes each: byte 4 r + c holds columns 8 G + c and 8 G + 4 + c of row r), then their 2 high bits per
// scale group of 16 columns, 64 bytes each: byte 4 r + c, bits 2 v and 2 v + 1, of columns 16 g + 4 v + c. A
// vector of codes (16 rows, 4 consecutive columns each) is then one nibble of a low vector with two bits of a high
// one, and a scale group is 4 VNNI instructions. 6.5625 bits per weight, as stored.
constexpr int64_t TILE_BLOCK_BYTES = inferno::Q6K_TILE_BLOCK_BYTES;
constexpr int64_t TILE_SCALES = 32, TILE_LOW = 288, TILE_HIGH = 2336;  // byte offsets in a tile's super-block
constexpr int64_t GROUPS = QK_K / 16;  // scale groups per super-block

void tile_super_block(const uint8_t* const* rows, uint8_t* out) {
  std::memset(out + TILE_HIGH, 0, TILE_BLOCK_BYTES - TILE_HIGH);
  for (int64_t r = 0; r < TILE_ROWS; ++r) {
    const uint8_t* blk = rows[r];
    std::memcpy(out + 2 * r, blk + 208, 2);
    for (int64_t g = 0; g < GROUPS; ++g) out[TILE_SCALES + TILE_ROWS * g + r] = blk[192 + g];
    int8_t codes[QK_K];
    block_codes(blk, codes);
    uint8_t q[QK_K];
    for (int64_t i = 0; i < QK_K; ++i) q[i] = static_cast<uint8_t>(codes[i] + 32);
    for (int64_t g = 0; g < QK_K / 8; ++g)
      for (int64_t c = 0; c < 4; ++c)
        out[TILE_LOW + 64 * g + 4 * r + c] = static_cast<uint8_t>((q[8 * g + c] & 0x0F) | (q[8 * g + 4 + c] & 0x0F) << 4);
    for (int64_t g = 0; g < GROUPS; ++g)
      for (int64_t v = 0; v < 4; ++v)
        for (int64_t c = 0; c < 4; ++c)
          out[TILE_HIGH + 64 * g + 4 * r + c] |= static_cast<uint8_t>((q[16 * g + 4 * v + c] >> 4) << (2 * v));
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t TILE_ROW_BLOCK = 8;

// One tile's 16 outputs for R rows of x (from row r0), super-blocks [s0, s1): per scale group and row of x, 4 VNNI
// instructions from the group's start, then one float multiply-add with d sc_g times the block's xs. The results are
// added to y unless `first`.
template <int64_t R>
void tile_rows(const TileRows& x, int64_t r0, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
               bool first) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), high2 = _mm512_set1_epi8(0x30);
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = tile + s * TILE_BLOCK_BYTES;
    const int64_t at = x.at(r0, s);
    const int8_t* xc = x.codes.data() + at * QK_K;  // row r's codes at xc + r * QK_K
    const float* xs = x.scales.data() + at * (QK_K / X_BLOCK);
    const int32_t* starts = x.starts.data() + at * GROUPS;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    for (int64_t g = 0; g < GROUPS; ++g) {
      const uint8_t* next = b + 2 * TILE_BLOCK_BYTES + 210 * g;  // a decode step streams the weights: 2 KB ahead
      for (int64_t line = 0; line < 210; line += 64) _mm_prefetch(reinterpret_cast<const char*>(next + line), _MM_HINT_T0);
      const __m512 ws = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + TILE_SCALES + TILE_ROWS * g)))));
      const __m512i low0 = _mm512_loadu_si512(b + TILE_LOW + 128 * g), low1 = _mm512_loadu_si512(b + TILE_LOW + 128 * g + 64);
      const __m512i high = _mm512_loadu_si512(b + TILE_HIGH + 64 * g);
      const __m512i w[4] = {
          _mm512_or_si512(_mm512_and_si512(low0, low4), _mm512_and_si512(_mm512_slli_epi16(high, 4), high2)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low0, 4), low4), _mm512_and_si512(_mm512_slli_epi16(high, 2), high2)),
          _mm512_or_si512(_mm512_and_si512(low1, low4), _mm512_and_si512(high, high2)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low1, 4), low4), _mm512_and_si512(_mm512_srli_epi16(high, 2), high2))};
      for (int64_t r = 0; r < R; ++r) {
        const int8_t* xg = xc + r * QK_K + 16 * g;
        __m512i dot = _mm512_set1_epi32(starts[GROUPS * r + g]);
        for (int64_t v = 0; v < 4; ++v) {
          int32_t xv;
          std::memcpy(&xv, xg + 4 * v, 4);
          dot = _mm512_dpbusd_epi32(dot, w[v], _mm512_set1_epi32(xv));
        }
        const __m512 scale = _mm512_mul_ps(ws, _mm512_set1_ps(xs[QK_K / X_BLOCK * r + g / 2]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) add_partial(y + (r0 + r) * n, acc[r], first);
}
#elif defined(__AVX2__)
constexpr int64_t TILE_ROW_BLOCK = 4;

// Vectors 2p and 2p + 1 of scale group g's codes (q in [0, 63], as the AVX-512 path makes them) of weight rows
// 8h .. 8h + 7: a nibble of TILE_LOW and two bits of TILE_HIGH each.
inline void code_pair(const uint8_t* b, int64_t g, int64_t h, int64_t p, __m256i& even, __m256i& odd) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + TILE_LOW + 128 * g + 64 * p + 32 * h));
  const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + TILE_HIGH + 64 * g + 32 * h));
  even = _mm256_or_si256(_mm256_and_si256(low, low4),
                         _mm256_and_si256(p ? high : _mm256_slli_epi16(high, 4), high2));
  odd = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low, 4), low4),
                        _mm256_and_si256(p ? _mm256_srli_epi16(high, 2) : _mm256_slli_epi16(high, 2), high2));
}

// Two vectors of codes times 4 codes of x each, added to an int32 sum: with AVX-VNNI two instructions; without,
// maddubs' pairs of the two summed in 16 bits (2 * 2 * 63 * 127 < 2^15) and widened once.
inline __m256i add_pair_dots(__m256i dot, __m256i even, __m256i odd, __m256i x_even, __m256i x_odd) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(dot, even, x_even), odd, x_odd);
#else
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(even, x_even), _mm256_maddubs_epi16(odd, x_odd));
  return _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// tile_rows of the AVX-512 path with each vector of 16 lanes as two halves of 8 (h = 0, 1), both halves per pair of
// code vectors: each broadcast of 4 codes of x serves both (see add_nibble_group).
template <int64_t R>
void tile_rows(const TileRows& x, int64_t r0, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
               bool first) {
  __m256 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = tile + s * TILE_BLOCK_BYTES;
    const int64_t at = x.at(r0, s);
    const int8_t* xc = x.codes.data() + at * QK_K;
    const float* xs = x.scales.data() + at * (QK_K / X_BLOCK);
    const int32_t* starts = x.starts.data() + at * GROUPS;
    const __m256 d[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))),
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16)))};
    for (int64_t g = 0; g < GROUPS; ++g) {
      const uint8_t* next = b + 2 * TILE_BLOCK_BYTES + 210 * g;  // a decode step streams the weights: 2 KB ahead
      for (int64_t line = 0; line < 210; line += 64) _mm_prefetch(reinterpret_cast<const char*>(next + line), _MM_HINT_T0);
      __m256i dots[R][2];
      for (int64_t r = 0; r < R; ++r) dots[r][0] = dots[r][1] = _mm256_set1_epi32(starts[GROUPS * r + g]);
      for (int64_t p = 0; p < 2; ++p) {
        __m256i w[2][2];  // [half][even, odd]
        for (int64_t h = 0; h < 2; ++h) code_pair(b, g, h, p, w[h][0], w[h][1]);
        for (int64_t r = 0; r < R; ++r) {
          int32_t xv[2];
          std::memcpy(xv, xc + r * QK_K + 16 * g + 8 * p, 8);
          const __m256i x_even = _mm256_set1_epi32(xv[0]), x_odd = _mm256_set1_epi32(xv[1]);
          for (int64_t h = 0; h < 2; ++h) dots[r][h] = add_pair_dots(dots[r][h], w[h][0], w[h][1], x_even, x_odd);
          asm("" : "+x"(dots[r][0]), "+x"(dots[r][1]));  // GCC would hoist the multiplies and spill them
        }
      }
      for (int64_t h = 0; h < 2; ++h) {
        const __m256 ws = _mm256_mul_ps(d[h], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                            reinterpret_cast<const __m128i*>(b + TILE_SCALES + TILE_ROWS * g + 8 * h)))));
        for (int64_t r = 0; r < R; ++r)
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r][h]),
                                      _mm256_mul_ps(ws, _mm256_set1_ps(xs[QK_K / X_BLOCK * r + g / 2])), acc[r][h]);
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
    for (int64_t g = 0; g < GROUPS; ++g) {
      const int64_t column = at * QK_K + 16 * g;
      for (int64_t row = 0; row < TILE_ROWS; ++row) {
        int32_t dot = x.starts[at * GROUPS + g];
        for (int64_t i = 0; i < 16; ++i) {
          const uint8_t low = b[TILE_LOW + 64 * (2 * g + i / 8) + 4 * row + i % 4] >> (4 * (i % 8 / 4)) & 0x0F;
          const uint8_t high = b[TILE_HIGH + 64 * g + 4 * row + i % 4] >> (2 * (i / 4)) & 3;
          dot += int32_t{static_cast<uint8_t>(low | high << 4)} * x.codes[column + i];
        }
        const float scale = half_at(b + 2 * row) * static_cast<float>(static_cast<int8_t>(b[TILE_SCALES + TILE_ROWS * g + row]));
        acc[row] += static_cast<float>(dot) * (scale * x.scales[column / X_BLOCK]);
      }
    }
  }
  for (int64_t row = 0; row < TILE_ROWS; ++row) add_partial(y + r0 * n + row, acc[row], first);
}
#endif

}  // namespace

namespace inferno::cpu {

void q6_k_tile(const View& blocks, const View& tiles) {
  tiled(blocks, tiles, BLOCK_BYTES, TILE_BLOCK_BYTES, tile_super_block);
}

void q6_k_tiles_matmul(const View& x, const View& tiles, const View& y) {
  tiles_matmul<TILE_ROW_BLOCK>(x, tiles, y, TILE_BLOCK_BYTES, true,
                               [](auto rows, const TileRows& rx, int64_t r, const uint8_t* tile, float* y,
                                  int64_t n, int64_t s0, int64_t s1, bool first) {
    tile_rows<decltype(rows)::value>(rx, r, tile, y, n, s0, s1, first);
  });
}

}  // namespace inferno::cpu
