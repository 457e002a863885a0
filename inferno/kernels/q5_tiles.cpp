// Q5 tiles: signed 5-bit codes (q - 16, q in [0, 31]) with a float16 scale per group of 32 columns, the GGUF Q5_0
// block, regrouped losslessly with weight rows in vector lanes as the int4 tiles are (quantized_gemv.cpp), at the
// 5.5 bits per weight the file stores instead of the Q8 tiles' 9. Registered as `q5_tile` and `q5_tiles_matmul`.
// Per block of 32 columns of a tile of 16 rows, Q5_TILE_BLOCK_BYTES bytes:
// - the rows' scales d (float16, as stored), 32 bytes;
// - the codes' fifth bits, 16 bytes per group g of 8 columns (4 groups): bit 4 r + c of the first 8 bytes is row r's
//   bit of column 8 g + c, of the next 8 its bit of column 8 g + 4 + c (c < 4);
// - the codes' low 4 bits in 4 groups of 64 bytes: byte 4 r + c of group g holds row r's column 8 g + c (low
//   nibble) and 8 g + 4 + c (high nibble).
// A group's nibbles with their fifth bits added are two vectors of unsigned codes q, 4 consecutive columns of a row
// per int32 lane: one VNNI instruction with 4 codes of a row of x broadcast adds 4 products to each of 16 rows, and
//   sum w x = d xs * (sum q xq) - 16 d * (sum of the block's rounded x)
// (the Q8 tiles' form, with 16 where they take back 128).
#include "quantized_rows.h"

#include <atomic>

namespace {

using inferno::Q5_TILE_BLOCK_BYTES;
constexpr int64_t Q5_TILE_BITS = 32, Q5_TILE_CODES = 96;  // byte offsets in a tile block

// Row r's code of column i of a tile block `b` (0 to 31: the stored q, the weight is d (q - 16)).
inline int32_t q5_code(const uint8_t* b, int64_t r, int64_t i) {
  const int64_t g = i / 8, c = i % 4, high = i % 8 / 4;
  const uint8_t nibbles = b[Q5_TILE_CODES + 64 * g + 4 * r + c];
  const uint8_t bits = b[Q5_TILE_BITS + 16 * g + 8 * high + r / 2];
  return (high ? nibbles >> 4 : nibbles & 0x0F) | (((bits >> (4 * (r % 2) + c)) & 1) << 4);
}

}  // namespace

namespace inferno::cpu {

// codes [N, K] int8 and scales [N, K / 32] float32 -> tiles; false where a code is outside [-16, 15] or a scale is
// not a float16 value (those tiles are then not the weight)
bool q5_tile(const View& codes, const View& scales, const View& tiles) {
  const int64_t n = codes.size(0), k = codes.size(1), blocks = k / X_BLOCK;
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  uint8_t* tp = tiles.data_ptr<uint8_t>();
  std::atomic<bool> exact{true};
  inferno::parallel_for(0, n / TILE_ROWS * blocks, 64, [&](int64_t begin, int64_t end) {
    bool chunk_exact = true;
    for (int64_t u = begin; u < end; ++u) {  // u = tile * blocks + block: the tiles' order
      const int64_t t = u / blocks, b = u % blocks;
      uint8_t* out = tp + u * Q5_TILE_BLOCK_BYTES;
      std::memset(out, 0, Q5_TILE_BLOCK_BYTES);
      for (int64_t r = 0; r < TILE_ROWS; ++r) {
        const int64_t row = t * TILE_ROWS + r;
        const float scale = sp[row * blocks + b];
        const c10::Half d(scale);
        chunk_exact &= static_cast<float>(d) == scale;
        std::memcpy(out + 2 * r, &d.x, 2);
        const int8_t* c = cp + row * k + b * X_BLOCK;
        for (int64_t i = 0; i < X_BLOCK; ++i) {
          const int64_t g = i / 8, high = i % 8 / 4, lane = 4 * r + i % 4;
          chunk_exact &= c[i] >= -16 && c[i] <= 15;
          const uint8_t q = static_cast<uint8_t>(c[i] + 16);
          out[Q5_TILE_CODES + 64 * g + lane] |= static_cast<uint8_t>((q & 0x0F) << (4 * high));
          out[Q5_TILE_BITS + 16 * g + 8 * high + lane / 8] |= static_cast<uint8_t>(((q >> 4) & 1) << (lane % 8));
        }
      }
    }
    if (!chunk_exact) exact = false;
  });
  return exact;
}

}  // namespace inferno::cpu

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t Q5_TILE_ROW_BLOCK = 8;

// One tile's 16 outputs for R rows of x (from row r0), blocks [s0, s1): per block and row of x, 8 VNNI instructions,
// then a float multiply-add with d times the block's xs and one with -16 d times its sum. Added to y unless `first`.
template <int64_t R>
void q5_tile_rows(const TileRows& x, int64_t r0, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
                  bool first) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = tile + s * Q5_TILE_BLOCK_BYTES;
    prefetch_ahead(b, Q5_TILE_BLOCK_BYTES);  // a decode step streams the weights
    const int64_t at = x.at(r0, s);
    const int8_t* xc = x.codes.data() + at * X_BLOCK;  // row r's codes at xc + r * X_BLOCK
    const float *xs = x.scales.data() + at, *xm = x.sums.data() + at;
    __m512i dots[R];
    for (int64_t r = 0; r < R; ++r) dots[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int64_t g = 0; g < 4; ++g) {
      const __m512i codes = _mm512_loadu_si512(b + Q5_TILE_CODES + 64 * g);
      uint64_t bits_low, bits_high;
      std::memcpy(&bits_low, b + Q5_TILE_BITS + 16 * g, 8);
      std::memcpy(&bits_high, b + Q5_TILE_BITS + 16 * g + 8, 8);
      const __m512i low4s = _mm512_and_si512(codes, low4);
      const __m512i q_low = _mm512_mask_add_epi8(low4s, _cvtu64_mask64(bits_low), low4s, fifth);
      const __m512i high4 = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low4);
      const __m512i q_high = _mm512_mask_add_epi8(high4, _cvtu64_mask64(bits_high), high4, fifth);
      for (int64_t r = 0; r < R; ++r) {
        int32_t x_low, x_high;
        std::memcpy(&x_low, xc + r * X_BLOCK + 8 * g, 4);
        std::memcpy(&x_high, xc + r * X_BLOCK + 8 * g + 4, 4);
        dots[r] = _mm512_dpbusd_epi32(dots[r], q_low, _mm512_set1_epi32(x_low));
        dots[r] = _mm512_dpbusd_epi32(dots[r], q_high, _mm512_set1_epi32(x_high));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    const __m512 offset = _mm512_mul_ps(d, _mm512_set1_ps(-16.f));
    for (int64_t r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_mul_ps(d, _mm512_set1_ps(xs[r])), acc[r]);
      acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xm[r]), acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) add_partial(y + (r0 + r) * n, acc[r], first);
}
#elif defined(__AVX2__)
constexpr int64_t Q5_TILE_ROW_BLOCK = 4;

// 32 bits -> 32 bytes, 0x10 where the bit is set (byte i: bit i)
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), spread);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

// q5_tile_rows of the AVX-512 path with each vector of 16 lanes as two halves of 8 (h = 0, 1). Without AVX-VNNI,
// maddubs adds pairs of products into 16 bits (at most 2 * 31 * 127 = 7874) and a group's two are summed there
// before one widening.
template <int64_t R>
void q5_tile_rows(const TileRows& x, int64_t r0, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
                  bool first) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = tile + s * Q5_TILE_BLOCK_BYTES;
    prefetch_ahead(b, Q5_TILE_BLOCK_BYTES);  // a decode step streams the weights
    const int64_t at = x.at(r0, s);
    const int8_t* xc = x.codes.data() + at * X_BLOCK;
    const float *xs = x.scales.data() + at, *xm = x.sums.data() + at;
    for (int64_t h = 0; h < 2; ++h) {
      __m256i dots[R];
      for (int64_t r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
      for (int64_t g = 0; g < 4; ++g) {
        const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + Q5_TILE_CODES + 64 * g + 32 * h));
        uint32_t bits_low, bits_high;
        std::memcpy(&bits_low, b + Q5_TILE_BITS + 16 * g + 4 * h, 4);
        std::memcpy(&bits_high, b + Q5_TILE_BITS + 16 * g + 8 + 4 * h, 4);
        const __m256i q_low = _mm256_or_si256(_mm256_and_si256(codes, low4), fifth_bits(bits_low));
        const __m256i q_high = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(codes, 4), low4),
                                               fifth_bits(bits_high));
        for (int64_t r = 0; r < R; ++r) {
          int32_t x_low, x_high;
          std::memcpy(&x_low, xc + r * X_BLOCK + 8 * g, 4);
          std::memcpy(&x_high, xc + r * X_BLOCK + 8 * g + 4, 4);
          const __m256i xl = _mm256_set1_epi32(x_low), xh = _mm256_set1_epi32(x_high);
#if defined(__AVXVNNI__)
          dots[r] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(dots[r], q_low, xl), q_high, xh);
#else
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(q_low, xl), _mm256_maddubs_epi16(q_high, xh));
          dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * h)));
      const __m256 offset = _mm256_mul_ps(d, _mm256_set1_ps(-16.f));
      for (int64_t r = 0; r < R; ++r) {
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_mul_ps(d, _mm256_set1_ps(xs[r])), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xm[r]), acc[r][h]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < 2; ++h) add_partial(y + (r0 + r) * n + 8 * h, acc[r][h], first);
}
#else
constexpr int64_t Q5_TILE_ROW_BLOCK = 1;

template <int64_t R>
void q5_tile_rows(const TileRows& x, int64_t r0, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
                  bool first) {
  static_assert(R == 1);
  float acc[TILE_ROWS] = {};
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = tile + s * Q5_TILE_BLOCK_BYTES;
    const int64_t at = x.at(r0, s);
    const int8_t* xc = x.codes.data() + at * X_BLOCK;
    for (int64_t row = 0; row < TILE_ROWS; ++row) {
      int32_t dot = 0;
      for (int64_t i = 0; i < X_BLOCK; ++i) dot += q5_code(b, row, i) * xc[i];
      const float d = half_at(b + 2 * row);
      acc[row] += static_cast<float>(dot) * (d * x.scales[at]) + (-16.f * d) * x.sums[at];
    }
  }
  for (int64_t row = 0; row < TILE_ROWS; ++row) add_partial(y + r0 * n + row, acc[row], first);
}
#endif

}  // namespace

namespace inferno::cpu {

void q5_tiles_matmul(const View& x, const View& tiles, const View& y) {
  tiles_matmul<Q5_TILE_ROW_BLOCK>(
      x, tiles, y, Q5_TILE_BLOCK_BYTES, false,
      [](auto rows, const TileRows& rx, int64_t r, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
         bool first) { q5_tile_rows<decltype(rows)::value>(rx, r, tile, y, n, s0, s1, first); },
      X_BLOCK);
}

}  // namespace inferno::cpu
