// Matrix products with quantized weights on the CPU, for the few rows of a decode step. Registered as operators
// of the `inferno` namespace (ops.cpp) so that eager calls go through the dispatcher and `torch.compile` can
// place them in a graph.
//
// 1. `int8_group_matmul`: group-wise int8 weights times float32 activations,
//    y[M, N] = x[M, K] @ W[N, K]^T with W[n, k] = codes[n, k] * scales[n, g] + mins[n, g], g = k / group_size.
//    Per output row and group, sum_i W_i x_i = scale * (sum_i q_i x_i) + min * (sum_i x_i): the codes are
//    converted to float once and multiplied with up to ROW_BLOCK rows of x; the per-group sums of x are
//    computed once per call. The codes [N, K] stream contiguously, one output row after another; threads split N.
// 2. `int8_q8_matmul` and `int4_q8_matmul`: signed int8 groups of 16/32 (optionally with mins) / int4 weights times
//    activations quantized to int8 per block of 32 (absmax), integer dot products as llama.cpp computes them (see
//    each below).
// 3. `int8_q8_dequantize` and `int4_dequantize`: to float32 or bfloat16, for the dense GEMM of prefill.
// Built once per ISA level (inferno/cpu_features.py): AVX-512 VNNI paths, AVX2 paths (Zen 2/3, Haswell on; AVX-VNNI
// where the compiler defines it), and plain loops for anything else.
#include "quantized_rows.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t LANES = 16;  // float32 in one vector register
#else
constexpr int64_t LANES = 8;  // AVX2 (wider GCC vectors go through memory there: 10x slower)
#endif
constexpr int64_t ROW_BLOCK = 4;  // rows of x sharing one conversion of the codes
typedef float floatv __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t intv __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint8_t bytev __attribute__((vector_size(LANES)));

inline floatv load_codes(const uint8_t* p) {
#if defined(__AVX512F__)
  return (floatv)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (floatv)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else  // GCC 12 widens bytes lane by lane here
  bytev v;
  std::memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(__builtin_convertvector(v, intv), floatv);
#endif
}

inline floatv load_floats(const float* p) {
  floatv v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float sum_lanes(floatv v) {
  float s = 0.f;
  for (int64_t i = 0; i < LANES; ++i) s += v[i];
  return s;
}

// sum_i q_i x[r, i] over one group [begin, end) of one output row, for R rows of x; GROUP > 0: a whole group of
// that many columns known at compile time (fully unrolled), 0: `end - begin` columns with a scalar tail.
template <int64_t R, int64_t GROUP>
inline void group_dots(const float* x, int64_t ldx, const uint8_t* codes, int64_t begin, int64_t end,
                       floatv (&vec)[R], float (&tail)[R]) {
  const int64_t full_end = GROUP > 0 ? begin + GROUP : begin + (end - begin) / LANES * LANES;
#pragma GCC unroll 8
  for (int64_t i = begin; i < full_end; i += LANES) {
    const floatv w = load_codes(codes + i);
    for (int64_t r = 0; r < R; ++r) vec[r] += w * load_floats(x + r * ldx + i);
  }
  if (GROUP == 0)
    for (int64_t i = full_end; i < end; ++i)
      for (int64_t r = 0; r < R; ++r) tail[r] += static_cast<float>(codes[i]) * x[r * ldx + i];
}

// y[r * ldy] = x[r] . W[n] for R rows of x and one output row n (codes, scales, mins: that row's).
template <int64_t R, int64_t GROUP>
inline void dot_rows(const float* x, int64_t ldx, const float* x_sums, int64_t groups, const uint8_t* codes,
                     const float* scales, const float* mins, int64_t k, int64_t group_size, float* y, int64_t ldy) {
  floatv acc[R] = {};
  float rest[R] = {};  // min terms and the scalar tail of a last, partial group
  const int64_t whole_groups = k / group_size;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t begin = g * group_size;
    floatv vec[R] = {};
    float tail[R] = {};
    if (GROUP > 0 && g < whole_groups)
      group_dots<R, GROUP>(x, ldx, codes, begin, begin + GROUP, vec, tail);
    else
      group_dots<R, 0>(x, ldx, codes, begin, std::min(begin + group_size, k), vec, tail);
    const float scale = scales[g], min = mins[g];
    for (int64_t r = 0; r < R; ++r) {
      acc[r] += scale * vec[r];
      rest[r] += scale * tail[r] + min * x_sums[r * groups + g];
    }
  }
  for (int64_t r = 0; r < R; ++r) y[r * ldy] = sum_lanes(acc[r]) + rest[r];
}

// All M rows of x against output rows [begin, end) of W.
template <int64_t GROUP>
void matmul_rows(const float* x, const float* x_sums, const uint8_t* codes, const float* scales, const float* mins,
                 float* y, int64_t m, int64_t n, int64_t k, int64_t group_size, int64_t groups, int64_t begin,
                 int64_t end) {
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* c = codes + j * k;
    const float *s = scales + j * groups, *mn = mins + j * groups;
    for_row_blocks<ROW_BLOCK>(m, [&](auto rows, int64_t r) {
      dot_rows<decltype(rows)::value, GROUP>(x + r * k, k, x_sums + r * groups, groups, c, s, mn, k, group_size,
                                             y + r * n + j, n);
    });
  }
}

}  // namespace

namespace inferno::cpu {

void int8_group_matmul(const View& x, const View& codes, const View& scales, const View& mins, int64_t group_size,
                       const View& y) {
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0), groups = scales.size(1);
  if (m == 0 || n == 0) return;
  const float* xp = x.data_ptr<float>();
  std::vector<float> x_sums(m * groups, 0.f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) x_sums[r * groups + i / group_size] += xp[r * k + i];
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *sp = scales.data_ptr<float>(), *mp = mins.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  inferno::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    const auto run = group_size == 32 ? matmul_rows<32> : group_size == 64 ? matmul_rows<64>
                   : group_size == 128 ? matmul_rows<128> : matmul_rows<0>;
    run(xp, x_sums.data(), cp, sp, mp, yp, m, n, k, group_size, groups, begin, end);
  });
}

void int8_group_dequantize(const View& codes, const View& scales, const View& mins, int64_t group_size,
                           const View& w) {
  const int64_t n = codes.size(0), k = codes.size(1), groups = scales.size(1);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *sp = scales.data_ptr<float>(), *mp = mins.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  inferno::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = j * k + g * group_size, last = j * k + std::min((g + 1) * group_size, k);
        const float scale = sp[j * groups + g], min = mp[j * groups + g];
#pragma omp simd
        for (int64_t i = first; i < last; ++i) wp[i] = static_cast<float>(cp[i]) * scale + min;
      }
  });
}

}  // namespace inferno::cpu

namespace {

// ---- weights times activations quantized to int8 per block of 32 (QuantizedRows) ----
// With AVX-512 VNNI one instruction multiplies 64 unsigned weight codes by 64 signed activation codes and adds
// them, 4 by 4, into 16 int32 lanes: lanes 0-7 hold one block, 8-15 the next. A weight offset c0 (codes c + c0
// stored unsigned) is taken out of the integer sums before any rounding: its -c0 * sum xq is spread over the
// block's 8 lanes and loaded as the accumulator's start, so no large terms cancel in floating point.

// The int4 layout: per output row, the codes in chunks of 16 blocks of 32 columns (the last chunk may hold fewer,
// nb blocks), then one float16 scale d per group, then one float16 min per group (w = code * d + min, the GGUF
// Q4_1 form) or, with `zero_points`, one integer zero point z per group held in a float16 (w = (code - z) * d, the
// AWQ / GPTQ form: z * d is exact in float32, not in float16); a row is one contiguous stream. A chunk is 4 runs of 4 * nb bytes: in run v, bytes 4l..4l+3 hold
// codes 4v..4v+3 of the chunk's block l in their low nibbles and codes 16+4v..16+4v+3 in their high nibbles. So
// each unpacked run is two vectors with one block per 32-bit lane: one VNNI instruction adds 4 products to each of
// 16 blocks' sums, 8 instructions finish them, and the float work is per 16 blocks instead of per block.
constexpr int64_t CHUNK_BLOCKS = 16;
constexpr int64_t CHUNK_BYTES = CHUNK_BLOCKS * X_BLOCK / 2;

using inferno::int4_row_bytes;

// The 32 codes of block b (of `blocks`) of a row, in column order.
inline void int4_block_codes(const uint8_t* row, int64_t blocks, int64_t b, uint8_t* codes) {
  const int64_t c = b / CHUNK_BLOCKS, l = b % CHUNK_BLOCKS, nb = std::min(CHUNK_BLOCKS, blocks - c * CHUNK_BLOCKS);
  const uint8_t* chunk = row + c * CHUNK_BYTES + 4 * l;
  int32_t runs[4];  // the block's 4 bytes of each run: codes 4v..4v+3 (low nibbles), 16+4v.. (high)
  for (int64_t v = 0; v < 4; ++v) std::memcpy(&runs[v], chunk + v * 4 * nb, 4);
#if defined(__SSE2__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(runs)), low4 = _mm_set1_epi8(0x0F);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm_and_si128(bytes, low4));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16), _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
#else
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(runs);
  for (int64_t i = 0; i < 16; ++i) {
    codes[i] = bytes[i] & 0x0F;
    codes[16 + i] = bytes[i] >> 4;
  }
#endif
}

// The kernels' per-group constant min + 8 d (they sum (code - 8) * xq): (8 - z) * d with zero points, exact.
inline float int4_zero_point(float d, float min_or_zero, bool zero_points) {
  return zero_points ? (8.f - min_or_zero) * d : 8.f * d + min_or_zero;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t VNNI_ROW_BLOCK = 8;  // rows of x per pass over the weights

struct PairVectors {  // per row of x and pair of blocks: the accumulator start and xs, 8 lanes per block
  std::vector<__m512i> starts;
  std::vector<__m512> scales;
};

PairVectors pair_vectors(const QuantizedRows& q, int64_t m, int64_t k) {
  const int64_t blocks = k / X_BLOCK, pairs = (blocks + 1) / 2;
  PairVectors v{std::vector<__m512i>(m * pairs), std::vector<__m512>(m * pairs)};
  for (int64_t r = 0; r < m; ++r)
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t b = r * blocks + 2 * p;
      const bool second = 2 * p + 1 < blocks;  // else a last, single block in the low lanes
      const int32_t per_lane = 128 / 8;  // the weights' offset (codes c + 128), spread over a block's 8 lanes
      v.starts[r * pairs + p] = _mm512_inserti32x8(_mm512_set1_epi32(-per_lane * q.code_sums[b]),
                                                   _mm256_set1_epi32(second ? -per_lane * q.code_sums[b + 1] : 0), 1);
      v.scales[r * pairs + p] = _mm512_insertf32x8(_mm512_set1_ps(q.scales[b]),
                                                   _mm256_set1_ps(second ? q.scales[b + 1] : 0.f), 1);
    }
  return v;
}

// int8: output rows [begin, end) for R rows of x
template <int64_t R>
void q8_rows(const int8_t* xq, const __m512i* starts, const __m512* x_scales, const int8_t* codes,
             const float* scales, float* y, int64_t n, int64_t k, int64_t begin, int64_t end) {
  const int64_t blocks = k / X_BLOCK, pairs = (blocks + 1) / 2;
  const __m512i flip = _mm512_set1_epi8(-128);  // c xor 0x80 = c + 128 as an unsigned byte
  for (int64_t j = begin; j < end; ++j) {
    const int8_t* c = codes + j * k;
    const float* s = scales + j * blocks;
    prefetch_ahead(c, k);
    _mm_prefetch(reinterpret_cast<const char*>(s + PREFETCH_BYTES / X_BLOCK), _MM_HINT_T0);
    __m512 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const bool whole = 2 * p + 1 < blocks;
      const __mmask64 bytes = whole ? ~__mmask64{0} : __mmask64{0xFFFFFFFF};
      const __m512i w = _mm512_xor_si512(_mm512_maskz_loadu_epi8(bytes, c + p * 2 * X_BLOCK), flip);  // c + 128
      const __m512 w_scale = _mm512_insertf32x8(_mm512_set1_ps(s[2 * p]), _mm256_set1_ps(whole ? s[2 * p + 1] : 0.f), 1);
      for (int64_t r = 0; r < R; ++r) {
        const __m512i x = _mm512_maskz_loadu_epi8(bytes, xq + r * k + p * 2 * X_BLOCK);
        const __m512i dot = _mm512_dpbusd_epi32(starts[r * pairs + p], w, x);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w_scale, x_scales[r * pairs + p]), acc[r]);
      }
    }
    for (int64_t r = 0; r < R; ++r) y[r * n + j] = _mm512_reduce_add_ps(acc[r]);
  }
}

void q8_matmul(const QuantizedRows& q, const int8_t* codes, const float* scales, float* y, int64_t m, int64_t n,
               int64_t k) {
  const int64_t pairs = (k / X_BLOCK + 1) / 2;
  const PairVectors v = pair_vectors(q, m, k);
  inferno::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for_row_blocks<VNNI_ROW_BLOCK>(m, [&](auto rows, int64_t r) {
      q8_rows<decltype(rows)::value>(q.codes.data() + r * k, v.starts.data() + r * pairs, v.scales.data() + r * pairs,
                                     codes, scales, y + r * n, n, k, begin, end);
    });
  });
}

// A chunk of nb blocks is loaded `runs_per_vector(nb)` runs at a time: a whole chunk one run per vector (lane l:
// block l), a last chunk of up to 8 / 4 blocks 2 / 4 runs per vector (lane p * nb + l: run p of the vector's
// runs, block l), so its blocks fill the lanes and it costs 4 / 2 VNNI instructions per row of x instead of 8
// (SmolLM2's 576 columns: a chunk of 16 blocks and one of 2).
inline int64_t runs_per_vector(int64_t nb) { return nb <= 4 ? 4 : nb <= 8 ? 2 : 1; }

struct ChunkedRows {  // the rows of x in the int4 chunk layout, per row and chunk:
  std::vector<__m512i> codes;   // [M, chunks, 8]: per vector of runs its low-, then high-nibble codes; 0 past the end
  std::vector<__m512i> starts;  // [M, chunks]: the accumulator start, -8 * (sum of the lane's codes)
  std::vector<__m512> scales;   // [M, chunks]: per lane the xs of its block
  std::vector<float> group_sums;  // [M, groups]: sums of the rounded values
};

ChunkedRows chunked_rows(const QuantizedRows& q, int64_t m, int64_t k, int64_t group_size) {
  const int64_t blocks = k / X_BLOCK, chunks = (blocks + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS;
  const int64_t per_group = group_size / X_BLOCK;
  ChunkedRows x{std::vector<__m512i>(m * chunks * 8, _mm512_setzero_si512()),
                std::vector<__m512i>(m * chunks, _mm512_setzero_si512()),
                std::vector<__m512>(m * chunks, _mm512_setzero_ps()), std::vector<float>(m * k / group_size, 0.f)};
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c = b / CHUNK_BLOCKS, l = b % CHUNK_BLOCKS, rb = r * blocks + b, rc = r * chunks + c;
      const int64_t nb = std::min(CHUNK_BLOCKS, blocks - c * CHUNK_BLOCKS), per_vector = runs_per_vector(nb);
      auto* lanes = reinterpret_cast<int32_t*>(x.codes.data() + rc * 8);
      auto* starts = reinterpret_cast<int32_t*>(&x.starts[rc]);
      auto* scales = reinterpret_cast<float*>(&x.scales[rc]);
      const int8_t* codes = &q.codes[rb * X_BLOCK];
      for (int64_t v = 0; v < 4; ++v) {  // run v: codes 4v..4v+3 (low nibbles) and 16+4v.. (high)
        const int64_t vector = v / per_vector, lane = v % per_vector * nb + l;
        std::memcpy(&lanes[2 * vector * LANES + lane], codes + 4 * v, 4);
        std::memcpy(&lanes[(2 * vector + 1) * LANES + lane], codes + 16 + 4 * v, 4);
        for (int64_t i = 0; i < 4; ++i) starts[lane] -= 8 * (codes[4 * v + i] + codes[16 + 4 * v + i]);
        scales[lane] = q.scales[rb];
      }
      x.group_sums[rb / per_group] += q.sums[rb];
    }
  return x;
}

// One chunk of an output row for R rows of x, VECTORS vectors of runs (`runs_per_vector`) known at compile time.
template <int64_t R, int64_t VECTORS>
inline void int4_chunk(const ChunkedRows& x, int64_t r0, int64_t c, int64_t chunks, const uint8_t* chunk,
                       int64_t vector_bytes, __m512 d_lanes, __m512 zero_point, __mmask16 live, int64_t groups,
                       int64_t g0, __m512 (&acc)[R]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __mmask64 bytes_mask = vector_bytes == 64 ? ~__mmask64{0} : (__mmask64{1} << vector_bytes) - 1;
  __m512i w[2 * VECTORS];
  for (int64_t v = 0; v < VECTORS; ++v) {
    const __m512i bytes = _mm512_maskz_loadu_epi8(bytes_mask, chunk + v * vector_bytes);
    w[2 * v] = _mm512_and_si512(bytes, low4);
    w[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t rc = (r0 + r) * chunks + c;
    const __m512i* xc = x.codes.data() + rc * 8;
    __m512i dot = x.starts[rc];
    for (int64_t t = 0; t < 2 * VECTORS; ++t) dot = _mm512_dpbusd_epi32(dot, w[t], xc[t]);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d_lanes, x.scales[rc]), acc[r]);
    acc[r] = _mm512_fmadd_ps(zero_point, _mm512_maskz_loadu_ps(live, x.group_sums.data() + (r0 + r) * groups + g0),
                             acc[r]);
  }
}

// int4: output rows [begin, end) for R rows of x (from row r0 of `x`). Per chunk the row's scales and mins of the
// chunk's groups are converted at once and spread to the blocks' lanes by a permutation (`pick`, or `last_pick`
// in the last chunk).
//   sum_k w x = sum_b d_g(b) * xs_b * (sum (c - 8) xq) + sum_g (min_g + 8 d_g) * sum_{k in g} x
template <int64_t R>
void int4_rows(const ChunkedRows& x, int64_t r0, __m512i pick, __m512i last_pick, const uint8_t* packed, float* y,
               int64_t n, int64_t k, int64_t group_size, bool zero_points, int64_t begin, int64_t end) {
  const int64_t blocks = k / X_BLOCK, chunks = (blocks + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS, groups = k / group_size;
  const int64_t per_group = group_size / X_BLOCK, row_bytes = int4_row_bytes(k, group_size);
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = packed + j * row_bytes;
    prefetch_ahead(row, row_bytes);
    const uint16_t* d = reinterpret_cast<const uint16_t*>(row + k / 2);
    const uint16_t* mins = d + groups;
    __m512 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t nb = std::min(CHUNK_BLOCKS, blocks - c * CHUNK_BLOCKS), g0 = c * CHUNK_BLOCKS / per_group;
      const __mmask16 live = static_cast<__mmask16>((1u << (nb / per_group)) - 1);  // the chunk's groups
      const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, d + g0));
      const __m512 second = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mins + g0));  // min or zero point
      const __m512 zero_point = zero_points ? _mm512_mul_ps(_mm512_sub_ps(_mm512_set1_ps(8.f), second), dv)
                                            : _mm512_fmadd_ps(_mm512_set1_ps(8.f), dv, second);
      const __m512 d_lanes = _mm512_permutexvar_ps(nb == CHUNK_BLOCKS ? pick : last_pick, dv);
      const int64_t per_vector = runs_per_vector(nb), vector_bytes = 4 * nb * per_vector;
      const uint8_t* chunk = row + c * CHUNK_BYTES;
      if (per_vector == 1)
        int4_chunk<R, 4>(x, r0, c, chunks, chunk, vector_bytes, d_lanes, zero_point, live, groups, g0, acc);
      else if (per_vector == 2)
        int4_chunk<R, 2>(x, r0, c, chunks, chunk, vector_bytes, d_lanes, zero_point, live, groups, g0, acc);
      else
        int4_chunk<R, 1>(x, r0, c, chunks, chunk, vector_bytes, d_lanes, zero_point, live, groups, g0, acc);
    }
    for (int64_t r = 0; r < R; ++r) y[r * n + j] = _mm512_reduce_add_ps(acc[r]);
  }
}

// Lane -> the chunk's group of its block, for a chunk of nb blocks.
__m512i lane_groups(int64_t nb, int64_t group_size) {
  alignas(64) int32_t groups[LANES];
  for (int64_t lane = 0; lane < LANES; ++lane) groups[lane] = lane % nb / (group_size / X_BLOCK);
  return _mm512_load_si512(groups);
}

void int4_matmul(const QuantizedRows& q, const uint8_t* packed, float* y, int64_t m, int64_t n, int64_t k,
                 int64_t group_size, bool zero_points) {
  const ChunkedRows x = chunked_rows(q, m, k, group_size);
  const int64_t last = k / X_BLOCK % CHUNK_BLOCKS;  // blocks of a last, partial chunk (0: none)
  const __m512i pick = lane_groups(CHUNK_BLOCKS, group_size), last_pick = lane_groups(last ? last : 1, group_size);
  inferno::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for_row_blocks<VNNI_ROW_BLOCK>(m, [&](auto rows, int64_t r) {
      int4_rows<decltype(rows)::value>(x, r, pick, last_pick, packed, y + r * n, n, k, group_size, zero_points,
                                       begin, end);
    });
  });
}
#elif defined(__AVX2__)
// With AVX2 (Zen 3, Haswell on): the same chunk layout in 256-bit vectors, 8 blocks per vector (one per 32-bit
// lane, 4 codes each): a half chunk of 8 blocks is one 32-byte slice of each of the chunk's 4 runs. Unsigned 4-bit
// codes times signed int8 activations go through _mm256_maddubs_epi16 (two products per 16-bit lane, at most
// 2 * 15 * 127 = 3810), and the 8 of a block's lane are summed in 16 bits (at most 8 * 3810 = 30480 < 2^15, no
// saturation) before one _mm256_madd_epi16 widens them: 8 + 7 + 1 instructions for the integer sums of 8 blocks.
// AVX-VNNI (_mm256_dpbusd_avx_epi32) does it in 8.

// sum over t of 4 products per 32-bit lane, w[t] unsigned 4-bit codes, x[t] signed int8, added to `start`
inline __m256i int4_lane_dots(__m256i start, const __m256i (&w)[8], const __m256i* x) {
#if defined(__AVXVNNI__)
  for (int64_t t = 0; t < 8; ++t) start = _mm256_dpbusd_avx_epi32(start, w[t], x[t]);
  return start;
#else
  __m256i pairs = _mm256_maddubs_epi16(w[0], x[0]);
  for (int64_t t = 1; t < 8; ++t) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[t], x[t]));
  return _mm256_add_epi32(start, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

struct LaneRows {  // the rows of x in the int4 chunk layout, per row and half chunk of 8 blocks (h = block / 8):
  std::vector<__m256i> codes;   // [M, halves, 8]: 8 vectors, lane l holding 4 codes of block 8h + l (0 past the end)
  std::vector<__m256i> starts;  // [M, halves]: -8 * (sum of the block's codes) in its lane
  std::vector<__m256> scales;   // [M, halves]: xs of the block in its lane
  std::vector<float> group_sums;  // [M, groups]: sums of the rounded values
};

LaneRows lane_rows(const QuantizedRows& q, int64_t m, int64_t k, int64_t group_size) {
  const int64_t blocks = k / X_BLOCK, halves = (blocks + 7) / 8, per_group = group_size / X_BLOCK;
  LaneRows x{std::vector<__m256i>(m * halves * 8, _mm256_setzero_si256()),
             std::vector<__m256i>(m * halves, _mm256_setzero_si256()),
             std::vector<__m256>(m * halves, _mm256_setzero_ps()), std::vector<float>(m * k / group_size, 0.f)};
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t h = r * halves + b / 8, l = b % 8, rb = r * blocks + b;
      auto* lanes = reinterpret_cast<int32_t*>(x.codes.data() + h * 8);
      for (int64_t t = 0; t < 8; ++t) std::memcpy(&lanes[t * 8 + l], &q.codes[rb * X_BLOCK + 4 * t], 4);
      reinterpret_cast<int32_t*>(&x.starts[h])[l] = -8 * q.code_sums[rb];
      reinterpret_cast<float*>(&x.scales[h])[l] = q.scales[rb];
      x.group_sums[rb / per_group] += q.sums[rb];
    }
  return x;
}

// The scales d of the groups of one half chunk (from d[0]), spread to its blocks' lanes by `pick`; lanes past
// `live` blocks are 0. Reading 8 float16 from d stays in the row when `fits` (the mins follow the scales).
inline __m256 half_chunk_scales(const uint16_t* d, bool fits, int64_t live, int64_t per_group, __m256i pick) {
  __m128i halves;
  if (fits) {
    halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d));
  } else {
    uint16_t buf[8] = {};
    std::memcpy(buf, d, (live / per_group) * sizeof(uint16_t));
    halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf));
  }
  const __m256 spread = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(halves), pick);
  if (live == 8) return spread;
  const __m256i alive = _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_and_ps(spread, _mm256_castsi256_ps(alive));
}

// int4: output rows [begin, end) for R rows of x (from row r0 of `x`), the sums of the AVX-512 kernel above.
template <int64_t R>
void int4_rows(const LaneRows& x, int64_t r0, __m256i pick, const uint8_t* packed, float* y, int64_t n, int64_t k,
               int64_t group_size, bool zero_points, int64_t begin, int64_t end) {
  const int64_t blocks = k / X_BLOCK, halves = (blocks + 7) / 8, groups = k / group_size;
  const int64_t per_group = group_size / X_BLOCK, row_bytes = int4_row_bytes(k, group_size);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = packed + j * row_bytes;
    prefetch_ahead(row, row_bytes);
    const uint16_t* d = reinterpret_cast<const uint16_t*>(row + k / 2);
    const uint16_t* mins = d + groups;
    __m256 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t h = 0; h < halves; ++h) {
      const int64_t c = h / 2, nb = std::min(CHUNK_BLOCKS, blocks - c * CHUNK_BLOCKS);
      const int64_t live = std::min<int64_t>(8, blocks - 8 * h), g0 = 8 * h / per_group;
      const __m256 d_blocks = half_chunk_scales(d + g0, g0 + 8 <= 2 * groups, live, per_group, pick);
      const uint8_t* half = row + c * CHUNK_BYTES + 32 * (h % 2);
      const __m256i live_lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      __m256i w[8];
      for (int64_t v = 0; v < 4; ++v) {
        const int32_t* run = reinterpret_cast<const int32_t*>(half + v * 4 * nb);
        const __m256i bytes = live == 8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run))
                                        : _mm256_maskload_epi32(run, live_lanes);
        w[v] = _mm256_and_si256(bytes, low4);
        w[v + 4] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t rh = (r0 + r) * halves + h;
        const __m256i dot = int4_lane_dots(x.starts[rh], w, x.codes.data() + rh * 8);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d_blocks, x.scales[rh]), acc[r]);
      }
    }
    // the zero points: sum_g (min_g + 8 d_g) * sum_{k in g} x
    float rest[R] = {};
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g)));
      const __m256 second = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + g)));
      const __m256 zero_point = zero_points ? _mm256_mul_ps(_mm256_sub_ps(_mm256_set1_ps(8.f), second), dv)
                                            : _mm256_fmadd_ps(_mm256_set1_ps(8.f), dv, second);
      for (int64_t r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(zero_point, _mm256_loadu_ps(x.group_sums.data() + (r0 + r) * groups + g), acc[r]);
    }
    for (; g < groups; ++g) {
      const float zero_point = int4_zero_point(_cvtsh_ss(d[g]), _cvtsh_ss(mins[g]), zero_points);
      for (int64_t r = 0; r < R; ++r) rest[r] += zero_point * x.group_sums[(r0 + r) * groups + g];
    }
    for (int64_t r = 0; r < R; ++r) y[r * n + j] = sum_lanes256(acc[r]) + rest[r];
  }
}

void int4_matmul(const QuantizedRows& q, const uint8_t* packed, float* y, int64_t m, int64_t n, int64_t k,
                 int64_t group_size, bool zero_points) {
  const LaneRows x = lane_rows(q, m, k, group_size);
  const __m256i pick = _mm256_srlv_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                         _mm256_set1_epi32(__builtin_ctzll(group_size / X_BLOCK)));
  inferno::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for_row_blocks<AVX2_ROW_BLOCK>(m, [&](auto rows, int64_t r) {
      int4_rows<decltype(rows)::value>(x, r, pick, packed, y + r * n, n, k, group_size, zero_points, begin, end);
    });
  });
}
#else  // the same sums, left to the compiler
void int4_matmul(const QuantizedRows& q, const uint8_t* packed, float* y, int64_t m, int64_t n, int64_t k,
                 int64_t group_size, bool zero_points) {
  const int64_t blocks = k / X_BLOCK, groups = k / group_size, row_bytes = int4_row_bytes(k, group_size);
  inferno::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> codes(k);
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* row = packed + j * row_bytes;
      for (int64_t b = 0; b < blocks; ++b) int4_block_codes(row, blocks, b, codes.data() + b * X_BLOCK);
      for (int64_t r = 0; r < m; ++r) {
        float acc = 0.f;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* c = codes.data() + b * X_BLOCK;
          const int8_t* x = q.codes.data() + r * k + b * X_BLOCK;
          int32_t dot = -8 * q.code_sums[r * blocks + b];  // (c - 8) inside the loop: GCC 12 turns it into a wrong
          for (int64_t i = 0; i < X_BLOCK; ++i)            // unsigned x signed dot product with AVX-VNNI
            dot += int32_t{c[i]} * int32_t{x[i]};
          const int64_t g = b * X_BLOCK / group_size;
          const float d = half_at(row + k / 2 + 2 * g), second = half_at(row + k / 2 + 2 * (groups + g));
          acc += static_cast<float>(dot) * d * q.scales[r * blocks + b] +
                 int4_zero_point(d, second, zero_points) * q.sums[r * blocks + b];
        }
        y[r * n + j] = acc;
      }
    }
  });
}
#endif

// ---- int4 tiles: the packed rows regrouped, losslessly, with weight rows in vector lanes (as q4_k_tile's) ----
// A tile is TILE_ROWS consecutive weight rows; per block of 32 columns INT4_TILE_BLOCK_BYTES bytes: the 16 rows'
// scales d (float16, the block's group's), then their second float16 (min, or zero point), then the codes in 4 groups
// of 8 columns, 64 bytes each: byte 4 r + c of group g holds row r's codes of columns 8 g + c (low nibble) and
// 8 g + 4 + c (high nibble). The 64 low (high) nibbles of a group are 16 rows' 4 consecutive codes, one 32-bit lane
// per weight row: one VNNI instruction (or maddubs) with 4 codes of a row of x broadcast adds 4 products to each of
// 16 outputs, no horizontal sums, and one load of codes serves every row of x of a pass. Per block of a row:
//   sum w x = d xs * (sum q xq) + min * (sum of the block's rounded x),  min = -zero * d with zero points
// Every value is kept (5 bits per weight with groups of 32, as the packed rows; 4 more bytes per 32 columns and row
// with groups of 64 or 128, whose scales every block repeats).
using inferno::INT4_TILE_BLOCK_BYTES;
constexpr int64_t INT4_TILE_SECONDS = 32, INT4_TILE_CODES = 64;  // byte offsets in a tile block

}  // namespace

namespace inferno::cpu {

void int4_tile(const View& packed, int64_t k, int64_t group_size, const View& tiles) {
  const int64_t n = packed.size(0), blocks = k / X_BLOCK, groups = k / group_size, row_bytes = int4_row_bytes(k, group_size);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  uint8_t* tp = tiles.data_ptr<uint8_t>();
  inferno::parallel_for(0, n / TILE_ROWS, 16, [&](int64_t begin, int64_t end) {
    uint8_t codes[X_BLOCK];
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r = 0; r < TILE_ROWS; ++r) {
        const uint8_t* row = pp + (t * TILE_ROWS + r) * row_bytes;
        for (int64_t b = 0; b < blocks; ++b) {
          uint8_t* out = tp + (t * blocks + b) * INT4_TILE_BLOCK_BYTES;
          const int64_t g = b * X_BLOCK / group_size;
          std::memcpy(out + 2 * r, row + k / 2 + 2 * g, 2);
          std::memcpy(out + INT4_TILE_SECONDS + 2 * r, row + k / 2 + 2 * (groups + g), 2);
          int4_block_codes(row, blocks, b, codes);
          for (int64_t q = 0; q < 4; ++q)
            for (int64_t c = 0; c < 4; ++c)
              out[INT4_TILE_CODES + 64 * q + 4 * r + c] = static_cast<uint8_t>(codes[8 * q + c] | (codes[8 * q + 4 + c] << 4));
        }
      }
  });
}

}  // namespace inferno::cpu

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t INT4_TILE_ROW_BLOCK = 8;

// One tile's 16 outputs for R rows of x (from row r0), blocks [s0, s1): per block and row of x, 8 VNNI instructions,
// then a float multiply-add with d times the block's xs and one with min times its sum. Added to y unless `first`.
template <int64_t R>
void int4_tile_rows(const TileRows& x, int64_t r0, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
                    bool first, bool zero_points) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = tile + s * INT4_TILE_BLOCK_BYTES;
    prefetch_ahead(b, INT4_TILE_BLOCK_BYTES);  // a decode step streams the weights
    const int64_t at = x.at(r0, s);
    const int8_t* xc = x.codes.data() + at * X_BLOCK;  // row r's codes at xc + r * X_BLOCK
    const float *xs = x.scales.data() + at, *xm = x.sums.data() + at;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    const __m512 second = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + INT4_TILE_SECONDS)));
    const __m512 min = zero_points ? _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), second), d) : second;
    __m512i dots[R];
    for (int64_t r = 0; r < R; ++r) dots[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int64_t g = 0; g < 4; ++g) {
      const __m512i codes = _mm512_loadu_si512(b + INT4_TILE_CODES + 64 * g);
      const __m512i low = _mm512_and_si512(codes, low4), high = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low4);
      for (int64_t r = 0; r < R; ++r) {
        int32_t x_low, x_high;
        std::memcpy(&x_low, xc + r * X_BLOCK + 8 * g, 4);
        std::memcpy(&x_high, xc + r * X_BLOCK + 8 * g + 4, 4);
        dots[r] = _mm512_dpbusd_epi32(dots[r], low, _mm512_set1_epi32(x_low));
        dots[r] = _mm512_dpbusd_epi32(dots[r], high, _mm512_set1_epi32(x_high));
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_mul_ps(d, _mm512_set1_ps(xs[r])), acc[r]);
      acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(xm[r]), acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) add_partial(y + (r0 + r) * n, acc[r], first);
}
#elif defined(__AVX2__)
constexpr int64_t INT4_TILE_ROW_BLOCK = 4;

// int4_tile_rows of the AVX-512 path with each vector of 16 lanes as two halves of 8 (h = 0, 1), both halves per group
// of codes (add_nibble_group)
template <int64_t R>
void int4_tile_rows(const TileRows& x, int64_t r0, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
                    bool first, bool zero_points) {
  __m256 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = tile + s * INT4_TILE_BLOCK_BYTES;
    prefetch_ahead(b, INT4_TILE_BLOCK_BYTES);  // a decode step streams the weights
    const int64_t at = x.at(r0, s);
    const int8_t* xc = x.codes.data() + at * X_BLOCK;
    const float *xs = x.scales.data() + at, *xm = x.sums.data() + at;
    NibbleDots dots[R][2];
    for (int64_t g = 0; g < 4; ++g) add_nibble_group(dots, b + INT4_TILE_CODES + 64 * g, xc + 8 * g, X_BLOCK);
    for (int64_t h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * h)));
      const __m256 second = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + INT4_TILE_SECONDS + 16 * h)));
      const __m256 min = zero_points ? _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), second), d) : second;
      for (int64_t r = 0; r < R; ++r) {
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r][h].total()), _mm256_mul_ps(d, _mm256_set1_ps(xs[r])), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(min, _mm256_set1_ps(xm[r]), acc[r][h]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < 2; ++h) add_partial(y + (r0 + r) * n + 8 * h, acc[r][h], first);
}
#else
constexpr int64_t INT4_TILE_ROW_BLOCK = 1;

template <int64_t R>
void int4_tile_rows(const TileRows& x, int64_t r0, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
                    bool first, bool zero_points) {
  static_assert(R == 1);
  float acc[TILE_ROWS] = {};
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = tile + s * INT4_TILE_BLOCK_BYTES;
    const int64_t at = x.at(r0, s);
    const int8_t* xc = x.codes.data() + at * X_BLOCK;
    int32_t dots[TILE_ROWS] = {};
    for (int64_t lane = 0; lane < 4 * 64; ++lane) {
      const int64_t g = lane / 64, row = lane % 64 / 4, column = 8 * g + lane % 4;
      const uint8_t codes = b[INT4_TILE_CODES + lane];
      dots[row] += int32_t{codes & 0x0F} * xc[column] + int32_t{codes >> 4} * xc[column + 4];
    }
    for (int64_t row = 0; row < TILE_ROWS; ++row) {
      const float d = half_at(b + 2 * row), second = half_at(b + INT4_TILE_SECONDS + 2 * row);
      const float min = zero_points ? -second * d : second;
      acc[row] += static_cast<float>(dots[row]) * (d * x.scales[at]) + min * x.sums[at];
    }
  }
  for (int64_t row = 0; row < TILE_ROWS; ++row) add_partial(y + r0 * n + row, acc[row], first);
}
#endif

}  // namespace

namespace inferno::cpu {

void int4_tiles_matmul(const View& x, const View& tiles, bool zero_points, const View& y) {
  tiles_matmul<INT4_TILE_ROW_BLOCK>(
      x, tiles, y, INT4_TILE_BLOCK_BYTES, false,
      [zero_points](auto rows, const TileRows& rx, int64_t r, const uint8_t* tile, float* y, int64_t n, int64_t s0,
                    int64_t s1, bool first) {
        int4_tile_rows<decltype(rows)::value>(rx, r, tile, y, n, s0, s1, first, zero_points);
      },
      X_BLOCK);
}

}  // namespace inferno::cpu

namespace {

// ---- Q8 tiles: signed int8 codes with a float32 scale per group of 32 (Q8_0, and Q5_0 as Q8Groups; no mins)
// regrouped, losslessly, with weight rows in vector lanes (as int4_tile's) ----
// Per block of 32 columns of a tile of 16 rows, Q8_TILE_BLOCK_BYTES bytes (9 bits per weight, as the codes and
// scales): the rows' scales d (float32), then the codes plus 128 (uint8) in 8 groups of 4 columns, 64 bytes each:
// byte 4 r + c of group g holds row r's code of column 4 g + c. With VNNI one instruction adds 4 products
// (q + 128) xq to each of 16 rows' lanes, and per block of a row
//   sum w x = d xs * (sum (q + 128) xq) - 128 d * (sum of the block's rounded x)
// (as the int4 tiles' min term); without VNNI, maddubs takes |q| times xq with q's sign (as llama.cpp does:
// 2 * 128 * 127 < 2^15), widened per vector, and sum w x = d xs * (sum q xq).
using inferno::Q8_TILE_BLOCK_BYTES;
constexpr int64_t Q8_TILE_CODES = 64;  // byte offset in a tile block

}  // namespace

namespace inferno::cpu {

void q8_tile(const View& codes, const View& scales, const View& tiles) {
  const int64_t n = codes.size(0), k = codes.size(1), blocks = k / X_BLOCK;
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  uint8_t* tp = tiles.data_ptr<uint8_t>();
  inferno::parallel_for(0, n / TILE_ROWS, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r = 0; r < TILE_ROWS; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t row = t * TILE_ROWS + r;
          const int8_t* c = cp + row * k + b * X_BLOCK;
          uint8_t* out = tp + (t * blocks + b) * Q8_TILE_BLOCK_BYTES;
          std::memcpy(out + 4 * r, sp + row * blocks + b, 4);
          for (int64_t i = 0; i < X_BLOCK; ++i)
            out[Q8_TILE_CODES + 64 * (i / 4) + 4 * r + i % 4] = static_cast<uint8_t>(c[i] ^ 0x80);  // q + 128
        }
  });
}

}  // namespace inferno::cpu

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t Q8_TILE_ROW_BLOCK = 8;

// One tile's 16 outputs for R rows of x (from row r0), blocks [s0, s1): per block and row of x, 8 VNNI instructions,
// then a float multiply-add with d times the block's xs and one with -128 d times its sum. Added to y unless `first`.
template <int64_t R>
void q8_tile_rows(const TileRows& x, int64_t r0, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
                  bool first) {
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = tile + s * Q8_TILE_BLOCK_BYTES;
    prefetch_ahead(b, Q8_TILE_BLOCK_BYTES);  // a decode step streams the weights
    const int64_t at = x.at(r0, s);
    const int8_t* xc = x.codes.data() + at * X_BLOCK;  // row r's codes at xc + r * X_BLOCK
    const float *xs = x.scales.data() + at, *xm = x.sums.data() + at;
    __m512i dots[R];
    for (int64_t r = 0; r < R; ++r) dots[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int64_t g = 0; g < 8; ++g) {
      const __m512i codes = _mm512_loadu_si512(b + Q8_TILE_CODES + 64 * g);
      for (int64_t r = 0; r < R; ++r) {
        int32_t xq;
        std::memcpy(&xq, xc + r * X_BLOCK + 4 * g, 4);
        dots[r] = _mm512_dpbusd_epi32(dots[r], codes, _mm512_set1_epi32(xq));
      }
    }
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(b)), offset = _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
    for (int64_t r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_mul_ps(d, _mm512_set1_ps(xs[r])), acc[r]);
      acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xm[r]), acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) add_partial(y + (r0 + r) * n, acc[r], first);
}
#elif defined(__AVX2__)
constexpr int64_t Q8_TILE_ROW_BLOCK = 4;

// q8_tile_rows of the AVX-512 path with each vector of 16 lanes as two halves of 8 (h = 0, 1)
template <int64_t R>
void q8_tile_rows(const TileRows& x, int64_t r0, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
                  bool first) {
  __m256 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = tile + s * Q8_TILE_BLOCK_BYTES;
    prefetch_ahead(b, Q8_TILE_BLOCK_BYTES);  // a decode step streams the weights
    const int64_t at = x.at(r0, s);
    const int8_t* xc = x.codes.data() + at * X_BLOCK;
    const float* xs = x.scales.data() + at;
#if defined(__AVXVNNI__)
    const float* xm = x.sums.data() + at;
#endif
    for (int64_t h = 0; h < 2; ++h) {
      __m256i dots[R];
      for (int64_t r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
#if !defined(__AVXVNNI__)
#pragma GCC unroll 1  // unrolled, GCC spills: 115 GMAC/s instead of 165 (LM head of SmolLM2, 32 rows)
#endif
      for (int64_t g = 0; g < 8; ++g) {
        const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + Q8_TILE_CODES + 64 * g + 32 * h));
#if defined(__AVXVNNI__)
        for (int64_t r = 0; r < R; ++r) {
          int32_t xq;
          std::memcpy(&xq, xc + r * X_BLOCK + 4 * g, 4);
          dots[r] = _mm256_dpbusd_avx_epi32(dots[r], codes, _mm256_set1_epi32(xq));
        }
#else
        const __m256i q = _mm256_xor_si256(codes, _mm256_set1_epi8(static_cast<char>(0x80)));
        const __m256i magnitudes = _mm256_sign_epi8(q, q);
        for (int64_t r = 0; r < R; ++r) {
          int32_t xq;
          std::memcpy(&xq, xc + r * X_BLOCK + 4 * g, 4);
          const __m256i x_signed = _mm256_sign_epi8(_mm256_set1_epi32(xq), q);
          dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, x_signed),
                                                                _mm256_set1_epi16(1)));
        }
#endif
      }
      const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(b) + 8 * h);
      for (int64_t r = 0; r < R; ++r)
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_mul_ps(d, _mm256_set1_ps(xs[r])), acc[r][h]);
#if defined(__AVXVNNI__)  // the codes' + 128 taken back
      const __m256 offset = _mm256_mul_ps(d, _mm256_set1_ps(-128.f));
      for (int64_t r = 0; r < R; ++r) acc[r][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xm[r]), acc[r][h]);
#endif
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < 2; ++h) add_partial(y + (r0 + r) * n + 8 * h, acc[r][h], first);
}
#else
constexpr int64_t Q8_TILE_ROW_BLOCK = 1;

template <int64_t R>
void q8_tile_rows(const TileRows& x, int64_t r0, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
                  bool first) {
  static_assert(R == 1);
  float acc[TILE_ROWS] = {};
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = tile + s * Q8_TILE_BLOCK_BYTES;
    const int64_t at = x.at(r0, s);
    const int8_t* xc = x.codes.data() + at * X_BLOCK;
    int32_t dots[TILE_ROWS] = {};
    for (int64_t lane = 0; lane < 8 * 64; ++lane) {
      const int64_t g = lane / 64, row = lane % 64 / 4, column = 4 * g + lane % 4;
      dots[row] += (int32_t{b[Q8_TILE_CODES + lane]} - 128) * xc[column];
    }
    for (int64_t row = 0; row < TILE_ROWS; ++row) {
      float d;
      std::memcpy(&d, b + 4 * row, 4);
      acc[row] += static_cast<float>(dots[row]) * (d * x.scales[at]);
    }
  }
  for (int64_t row = 0; row < TILE_ROWS; ++row) add_partial(y + r0 * n + row, acc[row], first);
}
#endif

}  // namespace

namespace inferno::cpu {

void q8_tiles_matmul(const View& x, const View& tiles, const View& y) {
  tiles_matmul<Q8_TILE_ROW_BLOCK>(
      x, tiles, y, Q8_TILE_BLOCK_BYTES, false,
      [](auto rows, const TileRows& rx, int64_t r, const uint8_t* tile, float* y, int64_t n, int64_t s0, int64_t s1,
         bool first) { q8_tile_rows<decltype(rows)::value>(rx, r, tile, y, n, s0, s1, first); },
      X_BLOCK);
}

}  // namespace inferno::cpu

namespace {

// ---- signed int8 groups of 16 or 32 (Q8Groups) times activations quantized to int8 per block of 32 ----
//   sum_k w x = sum_b xs_b * sum_{g in b} s_g * (sum_{k in g} c xq) + sum_g min_g * sum_{k in g} x
// One x block holds one group of 32 or two of 16. The AVX-512 kernel above runs symmetric groups of 32 (Q8_0);
// the rest, and everything on AVX2, runs the 256-bit kernel below (llama.cpp's way: |w| times x with w's sign,
// unsigned x signed bytes, 2 * 128 * 127 < 2^15 per 16-bit lane).
struct Q8Weights {
  const int8_t* codes;  // [N, K]
  const float* scales;  // [N, K / G]
  const float* mins;    // [N, K / G] or nullptr
};

// Per group of x, the sum of its rounded values (xs * code per column, exact in float32 for groups of 16 and 32).
std::vector<float> x_group_sums(const QuantizedRows& q, int64_t m, int64_t k, int64_t group_size) {
  std::vector<float> sums(m * k / group_size, 0.f);
  for (int64_t i = 0; i < m * k; ++i) sums[i / group_size] += q.scales[i / X_BLOCK] * static_cast<float>(q.codes[i]);
  return sums;
}

#if defined(__AVX2__)
inline __m256i signed_dots(__m256i w, __m256i x) {  // per 32-bit lane, the sum of 4 products w * x of int8
  const __m256i w_abs = _mm256_sign_epi8(w, w), x_signed = _mm256_sign_epi8(x, w);
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w_abs, x_signed);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w_abs, x_signed);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, x_signed), _mm256_set1_epi16(1));
#endif
}

// output rows [begin, end) for R rows of x (xq, xs: from that row on; x_sums per group of G, only with mins)
template <int64_t R, int64_t G>
void q8_groups_rows(const int8_t* xq, const float* xs, const float* x_sums, Q8Weights wt, float* y, int64_t n,
                    int64_t k, int64_t begin, int64_t end) {
  const int64_t blocks = k / X_BLOCK, groups = k / G;
  const __m256i two_groups = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);  // G = 16: lanes 0-3 and 4-7
  for (int64_t j = begin; j < end; ++j) {
    const int8_t* c = wt.codes + j * k;
    const float* s = wt.scales + j * groups;
    prefetch_ahead(c, k);
    __m256 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + b * X_BLOCK));
      __m256 w_scale;
      if constexpr (G == 32) {
        w_scale = _mm256_broadcast_ss(s + b);
      } else {
        const __m128 pair = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s + 2 * b)));
        w_scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair), two_groups);
      }
      for (int64_t r = 0; r < R; ++r) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * k + b * X_BLOCK));
        const __m256 scale = _mm256_mul_ps(w_scale, _mm256_broadcast_ss(xs + r * blocks + b));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(signed_dots(w, x)), scale, acc[r]);
      }
    }
    float rest[R] = {};
    if (wt.mins != nullptr) {
      const float* mn = wt.mins + j * groups;
      int64_t g = 0;
      for (; g + 8 <= groups; g += 8)
        for (int64_t r = 0; r < R; ++r)
          acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(mn + g), _mm256_loadu_ps(x_sums + r * groups + g), acc[r]);
      for (; g < groups; ++g)
        for (int64_t r = 0; r < R; ++r) rest[r] += mn[g] * x_sums[r * groups + g];
    }
    for (int64_t r = 0; r < R; ++r) y[r * n + j] = sum_lanes256(acc[r]) + rest[r];
  }
}

void q8_groups_matmul(const QuantizedRows& q, const float* x_sums, Q8Weights wt, float* y, int64_t m, int64_t n,
                      int64_t k, int64_t group_size) {
  const int64_t blocks = k / X_BLOCK, groups = k / group_size;
  inferno::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for_row_blocks<AVX2_ROW_BLOCK>(m, [&](auto rows, int64_t r) {
      constexpr int64_t R = decltype(rows)::value;
      const auto run = group_size == 32 ? q8_groups_rows<R, 32> : q8_groups_rows<R, 16>;
      run(q.codes.data() + r * k, q.scales.data() + r * blocks, x_sums + r * groups, wt, y + r * n, n, k, begin, end);
    });
  });
}
#else  // the same sums, left to the compiler
void q8_groups_matmul(const QuantizedRows& q, const float* x_sums, Q8Weights wt, float* y, int64_t m, int64_t n,
                      int64_t k, int64_t group_size) {
  const int64_t blocks = k / X_BLOCK, groups = k / group_size;
  inferno::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t r = 0; r < m; ++r) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const int8_t* c = wt.codes + j * k + g * group_size;
          const int8_t* x = q.codes.data() + r * k + g * group_size;
          int32_t dot = 0;
          for (int64_t i = 0; i < group_size; ++i) dot += int32_t{c[i]} * int32_t{x[i]};
          acc += static_cast<float>(dot) * wt.scales[j * groups + g] * q.scales[r * blocks + g * group_size / X_BLOCK];
          if (wt.mins != nullptr) acc += wt.mins[j * groups + g] * x_sums[r * groups + g];
        }
        y[r * n + j] = acc;
      }
  });
}
#endif

// ---- dequantization to float32 or bfloat16, for the dense GEMM of prefill and large batches ----
// In float32 as written, product then sum, never fused (as PyTorch and gguf's numpy compute them).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
}  // namespace

namespace inferno::cpu {

// packed [N, int4_row_bytes] uint8 -> W [N, K], w = code * d + min computed in float32 (min = -z * d with zero
// points: exact, and so is the sum)
void int4_dequantize(const View& packed, int64_t k, int64_t group_size, bool zero_points, const View& w) {
  const int64_t n = packed.size(0), groups = k / group_size, row_bytes = int4_row_bytes(k, group_size);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  dequantized(w, [&](auto* wp) {
    inferno::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> d(groups), mins(groups);
      for (int64_t j = begin; j < end; ++j) {
        const uint8_t* row = pp + j * row_bytes;
        for (int64_t g = 0; g < groups; ++g) {
          d[g] = half_at(row + k / 2 + 2 * g);
          const float second = half_at(row + k / 2 + 2 * (groups + g));
          mins[g] = zero_points ? -second * d[g] : second;
        }
        auto* out = wp + j * k;
        uint8_t codes[X_BLOCK];
        for (int64_t b = 0; b < k / X_BLOCK; ++b) {
          int4_block_codes(row, k / X_BLOCK, b, codes);
          const int64_t g = b * X_BLOCK / group_size;
          const float scale = d[g], min = mins[g];
#pragma omp simd
          for (int64_t i = 0; i < X_BLOCK; ++i) store(out + b * X_BLOCK + i, static_cast<float>(codes[i]) * scale + min);
        }
      }
    });
  });
}

}  // namespace inferno::cpu

namespace {

Q8Weights q8_weights(const inferno::View& codes, const inferno::View& scales, const inferno::View* mins) {
  return {codes.data_ptr<int8_t>(), scales.data_ptr<float>(), mins ? mins->data_ptr<float>() : nullptr};
}

}  // namespace

namespace inferno::cpu {

void int8_q8_dequantize(const View& codes, const View& scales, const View* mins, int64_t group_size, const View& w) {
  const int64_t n = codes.size(0), k = codes.size(1), groups = k / group_size;
  const Q8Weights wt = q8_weights(codes, scales, mins);
  dequantized(w, [&](auto* wp) {
    inferno::parallel_for(0, n * groups, 256, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const float scale = wt.scales[g], min = wt.mins ? wt.mins[g] : 0.f;
        for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i)
          store(wp + i, wt.mins ? static_cast<float>(wt.codes[i]) * scale + min : static_cast<float>(wt.codes[i]) * scale);
      }
    });
  });
}

#pragma GCC pop_options

void int8_q8_matmul(const View& x, const View& codes, const View& scales, const View* mins, int64_t group_size,
                    const View& y) {
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0);
  if (m == 0 || n == 0) return;
  const float* xp = x.data_ptr<float>();
  const QuantizedRows q = quantize_rows(xp, m, k);
  const Q8Weights wt = q8_weights(codes, scales, mins);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (group_size == 32 && !mins) {
    q8_matmul(q, wt.codes, wt.scales, y.data_ptr<float>(), m, n, k);
    return;
  }
#endif
  const std::vector<float> x_sums = mins ? x_group_sums(q, m, k, group_size) : std::vector<float>();
  q8_groups_matmul(q, x_sums.data(), wt, y.data_ptr<float>(), m, n, k, group_size);
}

void int4_q8_matmul(const View& x, const View& packed, int64_t group_size, bool zero_points, const View& y) {
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  if (m == 0 || n == 0) return;
  int4_matmul(quantize_rows(x.data_ptr<float>(), m, k), packed.data_ptr<uint8_t>(), y.data_ptr<float>(), m, n, k,
              group_size, zero_points);
}

}  // namespace inferno::cpu
