// Float vectors one register wide, for the kernels written with GCC vector extensions (paged_attention.cpp,
// prefill_attention.cpp, w8a8_activations.cpp): 16 floats with AVX-512, 8 with AVX2 (a vector wider than the
// registers compiles into stack traffic); loads that widen bfloat16 / float16 rows to float32 and stores that round
// them back, and exp. Everything here has internal linkage.
#pragma once

#include "kernel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
#else
constexpr int64_t LANES = 8;
#endif
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

typedef float floatv __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t intv __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t uintv __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t ushortv __attribute__((vector_size(LANES * sizeof(uint16_t))));

inline floatv load(const float* p) {
  floatv v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline floatv load(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  ushortv h;
  std::memcpy(&h, p, sizeof(h));
  return (floatv)(__builtin_convertvector(h, uintv) << 16);
}

inline floatv load(const c10::Half* p) {
#if defined(__AVX512F__)
  return (floatv)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  return (floatv)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  floatv v;
  for (int64_t i = 0; i < LANES; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline void store(float* p, floatv v) { std::memcpy(p, &v, sizeof(v)); }

// f(T*) with a null pointer of the C++ type of `dtype`: float32, bfloat16 or float16 (ops.cpp checked it is one)
template <typename F>
void dispatch_float_type(inferno::Dtype dtype, F&& f) {
  switch (dtype) {
    case inferno::Dtype::Float: f(static_cast<float*>(nullptr)); break;
    case inferno::Dtype::BFloat16: f(static_cast<c10::BFloat16*>(nullptr)); break;
    case inferno::Dtype::Half: f(static_cast<c10::Half*>(nullptr)); break;
    default: break;
  }
}

// f(T*, C*) for attention's queries T and caches C: one type, or float32 queries over float16 caches
template <typename F>
void dispatch_query_and_cache(inferno::Dtype query, inferno::Dtype cache, F&& f) {
  if (query != cache) {
    f(static_cast<float*>(nullptr), static_cast<c10::Half*>(nullptr));
    return;
  }
  dispatch_float_type(query, [&](auto* type) { f(type, type); });
}

// float32 -> bfloat16 bits, rounded to nearest even as c10::BFloat16 (a NaN stays a NaN)
inline ushortv to_bfloat16(floatv x) {
  const uintv bits = (uintv)x;
  const uintv rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uintv nan = (uintv)(x != x);
  return __builtin_convertvector((rounded & ~nan) | (0x7FC0u & nan), ushortv);
}

inline void store(c10::BFloat16* p, floatv v) {
  const ushortv h = to_bfloat16(v);
  std::memcpy(p, &h, sizeof(h));
}

inline void store(c10::Half* p, floatv v) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
#else
  for (int64_t i = 0; i < LANES; ++i) p[i] = static_cast<c10::Half>(v[i]);
#endif
}

// Cache rows are scattered over the pool block by block: fetch the next keys (and each key's value) ahead.
template <typename T>
inline void prefetch_row(const T* row, int64_t head_dim) {
  for (int64_t i = 0; i < head_dim * static_cast<int64_t>(sizeof(T)); i += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + i);
}

inline floatv splat(float x) { return floatv{} + x; }

inline float max_lanes(floatv v) {
  float m = v[0];
  for (int64_t i = 1; i < LANES; ++i) m = std::max(m, v[i]);
  return m;
}

inline float sum_lanes(floatv v) {
  float s = 0.f;
  for (int64_t i = 0; i < LANES; ++i) s += v[i];
  return s;
}

// exp(x) for x <= 0 (scores minus their max), relative error ~1e-7; 0 below -87 (and for -inf, masked keys).
inline floatv exp_lanes(floatv x) {
  const intv live = x > -87.f;
  x = x < -87.f ? splat(-87.f) : x;
  const floatv shifted = x * 1.44269504f + 12582912.f;  // 1.5 * 2^23: rounds x / ln 2 to an integer n
  const floatv n = shifted - 12582912.f;
  const floatv r = x - n * 0.693145752f - n * 1.42860677e-6f;  // ln 2 split in two for an exact reduction
  floatv p = splat(1.f / 720) * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const intv two_n = ((intv)shifted - 0x4B400000 + 127) << 23;  // 2^n built in the exponent bits
  return (floatv)((intv)(p * (floatv)two_n) & live);
}

}  // namespace
