// Group-wise int8 weights times float32 activations on the CPU, for the few rows of a decode step:
// y[M, N] = x[M, K] @ W[N, K]^T with W[n, k] = codes[n, k] * scales[n, g] + mins[n, g], g = k / group_size.
// Registered as the operator `inferno::int8_group_matmul` (a fragment of the `inferno` namespace) so that eager
// calls go through the dispatcher and `torch.compile` can place it in a graph.
//
// Per output row and group, sum_i W_i x_i = scale * (sum_i q_i x_i) + min * (sum_i x_i): the codes are
// converted to float once and multiplied with up to ROW_BLOCK rows of x; the per-group sums of x are
// computed once per call. The codes [N, K] stream contiguously, one output row after another; threads split N.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t LANES = 16;  // one AVX-512 register of float32 (two AVX2 registers)
constexpr int64_t ROW_BLOCK = 4;  // rows of x sharing one conversion of the codes
typedef float floatx16 __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t intx16 __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint8_t bytex16 __attribute__((vector_size(LANES)));

inline floatx16 load_codes(const uint8_t* p) {
#if defined(__AVX512F__)
  return (floatx16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else  // GCC 12 widens bytes lane by lane here; AVX-512 has one instruction for it
  bytex16 v;
  std::memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(__builtin_convertvector(v, intx16), floatx16);
#endif
}

inline floatx16 load_floats(const float* p) {
  floatx16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float sum_lanes(floatx16 v) {
  float s = 0.f;
  for (int64_t i = 0; i < LANES; ++i) s += v[i];
  return s;
}

// sum_i q_i x[r, i] over one group [begin, end) of one output row, for R rows of x; GROUP > 0: a whole group of
// that many columns known at compile time (fully unrolled), 0: `end - begin` columns with a scalar tail.
template <int64_t R, int64_t GROUP>
inline void group_dots(const float* x, int64_t ldx, const uint8_t* codes, int64_t begin, int64_t end,
                       floatx16 (&vec)[R], float (&tail)[R]) {
  const int64_t full_end = GROUP > 0 ? begin + GROUP : begin + (end - begin) / LANES * LANES;
#pragma GCC unroll 8
  for (int64_t i = begin; i < full_end; i += LANES) {
    const floatx16 w = load_codes(codes + i);
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
  floatx16 acc[R] = {};
  float rest[R] = {};  // min terms and the scalar tail of a last, partial group
  const int64_t whole_groups = k / group_size;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t begin = g * group_size;
    floatx16 vec[R] = {};
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
    int64_t r = 0;
    for (; r + ROW_BLOCK <= m; r += ROW_BLOCK)
      dot_rows<ROW_BLOCK, GROUP>(x + r * k, k, x_sums + r * groups, groups, c, s, mn, k, group_size, y + r * n + j, n);
    const float* xr = x + r * k;
    const float* sr = x_sums + r * groups;
    switch (m - r) {
      case 3: dot_rows<3, GROUP>(xr, k, sr, groups, c, s, mn, k, group_size, y + r * n + j, n); break;
      case 2: dot_rows<2, GROUP>(xr, k, sr, groups, c, s, mn, k, group_size, y + r * n + j, n); break;
      case 1: dot_rows<1, GROUP>(xr, k, sr, groups, c, s, mn, k, group_size, y + r * n + j, n); break;
      default: break;
    }
  }
}

void check_weight(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, int64_t group_size) {
  TORCH_CHECK(codes.dim() == 2 && scales.dim() == 2 && mins.dim() == 2, "codes, scales and mins must be 2-D");
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kFloat && mins.scalar_type() == at::kFloat,
              "scales and mins must be float32 and codes uint8");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && mins.is_contiguous(),
              "codes, scales and mins must be contiguous");
  TORCH_CHECK(group_size > 0, "group_size must be positive, got ", group_size);
  const int64_t n = codes.size(0), k = codes.size(1), groups = (k + group_size - 1) / group_size;
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == groups && mins.sizes() == scales.sizes(),
              "scales and mins must be [", n, ", ", groups, "] for ", k, " columns in groups of ", group_size);
}

// x [M, K] float32; codes [N, K] uint8; scales, mins [N, ceil(K / group_size)] float32 -> [M, N] float32
at::Tensor int8_group_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const at::Tensor& mins, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be 2-D, float32, contiguous");
  check_weight(codes, scales, mins, group_size);
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0), groups = scales.size(1);
  TORCH_CHECK(codes.size(1) == k, "x has ", k, " columns but codes have ", codes.size(1));
  auto y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const float* xp = x.data_ptr<float>();
  std::vector<float> x_sums(m * groups, 0.f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) x_sums[r * groups + i / group_size] += xp[r * k + i];
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *sp = scales.data_ptr<float>(), *mp = mins.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    const auto run = group_size == 32 ? matmul_rows<32> : group_size == 64 ? matmul_rows<64>
                   : group_size == 128 ? matmul_rows<128> : matmul_rows<0>;
    run(xp, x_sums.data(), cp, sp, mp, yp, m, n, k, group_size, groups, begin, end);
  });
  return y;
}

// codes [N, K] uint8; scales, mins [N, ceil(K / group_size)] float32 -> W [N, K] float32 (for a dense GEMM)
at::Tensor int8_group_dequantize(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                                 int64_t group_size) {
  check_weight(codes, scales, mins, group_size);
  const int64_t n = codes.size(0), k = codes.size(1), groups = scales.size(1);
  auto w = at::empty({n, k}, scales.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *sp = scales.data_ptr<float>(), *mp = mins.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = j * k + g * group_size, last = j * k + std::min((g + 1) * group_size, k);
        const float scale = sp[j * groups + g], min = mp[j * groups + g];
#pragma omp simd
        for (int64_t i = first; i < last; ++i) wp[i] = static_cast<float>(cp[i]) * scale + min;
      }
  });
  return w;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferno, m) {
  m.def("int8_group_matmul(Tensor x, Tensor codes, Tensor scales, Tensor mins, int group_size) -> Tensor");
  m.def("int8_group_dequantize(Tensor codes, Tensor scales, Tensor mins, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(inferno, CPU, m) {
  m.impl("int8_group_matmul", &int8_group_matmul);
  m.impl("int8_group_dequantize", &int8_group_dequantize);
}
