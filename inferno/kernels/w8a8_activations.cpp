// The activations of a W8A8 projection as its int8 GEMM takes them, in one pass over each row: times the layer's
// input scales (SmoothQuant factors it could not fold), rotated per block by the orthonormal Hadamard matrix
// (down_proj: an outlier channel spreads over its block), then quantized to unsigned bytes with zero point 128 and
// one scale per row, absmax / 127. Registered as `inferno::w8a8_quantize_rows`; `inferno::w8a8_scale_rows` finishes
// the GEMM's float32 output in one pass too: times the row scales, plus the bias, in the model's dtype.
//
// The rotation is a fast Walsh-Hadamard transform: log2(block) butterfly stages, (a, b) -> (a + b, a - b) at
// distance s. Stages at a distance of whole vectors add and subtract vectors; the shorter ones pair lanes of one
// vector (a shuffle and one multiply-add with a +1 / -1 vector). Sylvester's matrix is symmetric, so the transform
// equals x times the matrix that rotates the weights (inferno/layers/quantization/w8a8.py: `hadamard`, `rotate`).
#include "entry_points.h"
#include "float_vectors.h"

#include <cmath>
#include <type_traits>
#include <vector>

namespace {

constexpr float kLevels = 127.f;
constexpr float kZeroPoint = 128.f;

// The in-vector stage at distance s (< LANES): lane i pairs with lane i ^ s.
inline floatv butterfly_lanes(floatv x, int64_t s) {
  intv pair, sign_bit;
  for (int64_t i = 0; i < LANES; ++i) {
    pair[i] = static_cast<int32_t>(i ^ s);
    sign_bit[i] = (i & s) ? 1 : 0;
  }
  const floatv partner = __builtin_shuffle(x, pair);
  const floatv sign = sign_bit ? splat(-1.f) : splat(1.f);
  return partner + sign * x;  // lower lane: b + a; upper lane: a - b
}

// x[0:block] times the unnormalised Hadamard matrix, in place
inline void hadamard_block(float* x, int64_t block) {
  if (block < LANES) {  // a block narrower than a vector: scalar butterflies
    for (int64_t s = 1; s < block; s *= 2)
      for (int64_t i = 0; i < block; ++i)
        if (!(i & s)) {
          const float a = x[i], b = x[i + s];
          x[i] = a + b;
          x[i + s] = a - b;
        }
    return;
  }
  for (int64_t s = 1; s < LANES; s *= 2)
    for (int64_t i = 0; i < block; i += LANES) store(x + i, butterfly_lanes(load(x + i), s));
  for (int64_t s = LANES; s < block; s *= 2)
    for (int64_t i = 0; i < block; i += 2 * s)
      for (int64_t j = i; j < i + s; j += LANES) {
        const floatv a = load(x + j), b = load(x + j + s);
        store(x + j, a + b);
        store(x + j + s, a - b);
      }
}

typedef uint8_t bytev __attribute__((vector_size(LANES)));

// codes[i] = round(row[i] / scale) + 128 (ties to even, as torch.round)
inline void quantize_row(const float* row, float scale, uint8_t* codes, int64_t k) {
  int64_t i = 0;
  for (; i + LANES <= k; i += LANES) {
    const floatv rounded = (load(row + i) / scale + 12582912.f) - 12582912.f;  // 1.5 * 2^23: rounds to integer
    const bytev bytes = __builtin_convertvector(__builtin_convertvector(rounded + kZeroPoint, intv), bytev);
    std::memcpy(codes + i, &bytes, LANES);
  }
  for (; i < k; ++i) codes[i] = static_cast<uint8_t>(std::nearbyint(row[i] / scale) + kZeroPoint);
}

inline float absmax_of(const float* row, int64_t k) {
  floatv m{};
  int64_t i = 0;
  for (; i + LANES <= k; i += LANES) {
    const floatv a = load(row + i), b = -a;
    const floatv v = a > b ? a : b;
    m = v > m ? v : m;
  }
  float absmax = max_lanes(m);
  for (; i < k; ++i) absmax = std::max(absmax, std::abs(row[i]));
  return absmax;
}

template <typename T>
void quantize_rows(const T* x, const float* input_scales, int64_t block, uint8_t* codes, float* row_scales,
                   int64_t rows, int64_t k) {
  const float norm = block > 0 ? 1.f / std::sqrt(static_cast<float>(block)) : 1.f;
  inferno::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(k);
    for (int64_t m = begin; m < end; ++m) {
      const T* src = x + m * k;
      for (int64_t i = 0; i < k; ++i) row[i] = static_cast<float>(src[i]) * (input_scales ? input_scales[i] : 1.f);
      if (block > 0)
        for (int64_t i = 0; i < k; i += block) hadamard_block(row.data() + i, block);
      if (block > 0)
        for (int64_t i = 0; i < k; ++i) row[i] *= norm;
      row_scales[m] = std::max(absmax_of(row.data(), k), 1e-12f) / kLevels;
      quantize_row(row.data(), row_scales[m], codes + m * k, k);
    }
  });
}

// out[m, :] = y[m, :] * row_scales[m] + bias, as float32 (in place) or bfloat16
template <typename T>
void scale_rows(const float* y, const float* row_scales, const float* bias, T* out, int64_t rows, int64_t n) {
  inferno::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* src = y + m * n;
      T* dst = out + m * n;
      const float s = row_scales[m];
      int64_t i = 0;
      for (; i + LANES <= n; i += LANES) {
        floatv v = load(src + i) * s;
        if (bias) v += load(bias + i);
        store(dst + i, v);
      }
      for (; i < n; ++i) dst[i] = static_cast<T>(src[i] * s + (bias ? bias[i] : 0.f));
    }
  });
}

}  // namespace

namespace inferno::cpu {

void w8a8_quantize_rows(const View& x, const float* input_scales, int64_t rotation_block, const View& codes,
                        const View& row_scales) {
  if (x.scalar_type() == Dtype::Float)
    quantize_rows(x.data_ptr<float>(), input_scales, rotation_block, codes.data_ptr<uint8_t>(),
                  row_scales.data_ptr<float>(), x.size(0), x.size(1));
  else
    quantize_rows(x.data_ptr<c10::BFloat16>(), input_scales, rotation_block, codes.data_ptr<uint8_t>(),
                  row_scales.data_ptr<float>(), x.size(0), x.size(1));
}

void w8a8_scale_rows(const View& y, const float* row_scales, const float* bias, const View& out) {
  if (out.scalar_type() == Dtype::Float)
    scale_rows(y.data_ptr<float>(), row_scales, bias, out.data_ptr<float>(), y.size(0), y.size(1));
  else
    scale_rows(y.data_ptr<float>(), row_scales, bias, out.data_ptr<c10::BFloat16>(), y.size(0), y.size(1));
}

}  // namespace inferno::cpu
