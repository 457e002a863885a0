// The decoder's elementwise steps fused on the CPU, one pass over each row instead of one PyTorch operator (and one
// temporary) per step, for eager and compiled steps alike (the same rounding in both): the CPU twins of
// kernels/triton_fused.py. Registered as `inferno::rms_norm`, `inferno::add_rms_norm` (the residual added first),
// `inferno::silu_and_mul` and `inferno::rotary`. float32, bfloat16 and float16 rows; arithmetic in float32, rounded
// once to the row's dtype, except where the PyTorch path rounds in between and the result must stay the same (see
// rms_norm).
#include "kernel.h"

#include "float_vectors.h"

#include <cmath>
#include <type_traits>

namespace {

template <typename T>
inline T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

inline floatv round_to(floatv v, const float*) { return v; }
inline floatv round_to(floatv v, const c10::BFloat16*) {
  c10::BFloat16 tmp[LANES];
  store(tmp, v);
  return load(tmp);
}
inline floatv round_to(floatv v, const c10::Half*) {
  c10::Half tmp[LANES];
  store(tmp, v);
  return load(tmp);
}

// out = rms_norm(x + residual) * weight and sum = x + residual (rounded to T, as the PyTorch path adds in T), or
// out = rms_norm(x) * weight without a residual. float32 rows multiply by the weight in float32; 16-bit rows as
// layers/norm.py does: the normalised row rounded to T, then times the weight, rounded again.
template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* sum, int64_t rows, int64_t size,
                   float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(size);
    for (int64_t m = begin; m < end; ++m) {
      const T* src = x + m * size;
      floatv squares{};
      float tail = 0.f;
      int64_t i = 0;
      for (; i + LANES <= size; i += LANES) {
        floatv v = load(src + i);
        if (residual) {
          v = round_to(v + load(residual + m * size + i), src);
          store(sum + m * size + i, v);
        }
        store(row.data() + i, v);
        squares += v * v;
      }
      for (; i < size; ++i) {
        float v = static_cast<float>(src[i]);
        if (residual) {
          sum[m * size + i] = static_cast<T>(v + static_cast<float>(residual[m * size + i]));
          v = static_cast<float>(sum[m * size + i]);
        }
        row[i] = v;
        tail += v * v;
      }
      const float rstd = 1.f / std::sqrt((sum_lanes(squares) + tail) / static_cast<float>(size) + eps);
      T* dst = out + m * size;
      for (i = 0; i + LANES <= size; i += LANES) {
        const floatv normed = round_to(load(row.data() + i) * rstd, dst);
        store(dst + i, normed * load(weight + i));
      }
      for (; i < size; ++i)
        dst[i] = static_cast<T>(static_cast<float>(static_cast<T>(row[i] * rstd)) * static_cast<float>(weight[i]));
    }
  });
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: a contiguous [T, size] matrix");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight: one value per column, in x's dtype");
}

// x [T, size] contiguous, weight [size] of x's dtype -> rms_norm(x) * weight
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  auto out = at::empty_like(x);
  dispatch_float_type(x.scalar_type(), "rms_norm", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    rms_norm_rows<T>(ptr<T>(x), nullptr, ptr<T>(weight), ptr<T>(out), nullptr, x.size(0), x.size(1),
                     static_cast<float>(eps));
  });
  return out;
}

// x, residual [T, size] contiguous, weight [size], all of one dtype -> (rms_norm(x + residual) * weight, x + residual)
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "residual: like x");
  auto out = at::empty_like(x), sum = at::empty_like(x);
  dispatch_float_type(x.scalar_type(), "add_rms_norm", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    rms_norm_rows<T>(ptr<T>(x), ptr<T>(residual), ptr<T>(weight), ptr<T>(out), ptr<T>(sum), x.size(0), x.size(1),
                     static_cast<float>(eps));
  });
  return {out, sum};
}

// silu(g) = g / (1 + exp(-g)), with e = exp(-|g|) <= 1: g / (1 + e) for g >= 0, g e / (1 + e) below
inline floatv silu(floatv g) {
  const floatv magnitude = g < 0.f ? -g : g;
  const floatv e = exp_lanes(-magnitude);
  return (g < 0.f ? g * e : g) / (1.f + e);
}

// gate_up [T, 2 * inner] (gate, then up) -> silu(gate) * up [T, inner]
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up: a contiguous [T, 2 * inner] matrix");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto out = at::empty({rows, inner}, gate_up.options());
  dispatch_float_type(gate_up.scalar_type(), "silu_and_mul", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const T* src = ptr<T>(gate_up);
    T* dst = ptr<T>(out);
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const T* gate = src + m * 2 * inner;
        const T* up = gate + inner;
        int64_t i = 0;
        for (; i + LANES <= inner; i += LANES) store(dst + m * inner + i, silu(load(gate + i)) * load(up + i));
        for (; i < inner; ++i) {
          const float g = static_cast<float>(gate[i]);
          dst[m * inner + i] = static_cast<T>(g / (1.f + std::exp(-g)) * static_cast<float>(up[i]));
        }
      }
    });
  });
  return out;
}

// x [T, heads, head_dim] (head_dim contiguous; interleaved pairs) rotated by rotations [T, 1, head_dim / 2, 2]
// float32 (cos, sin of each pair's angle): (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos), into a new contiguous
// tensor (a copy, not in place: a compiled step calls it too, and in-place ops on views do not trace)
at::Tensor rotary(const at::Tensor& x, const at::Tensor& rotations) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x: [T, heads, head_dim], head_dim contiguous");
  TORCH_CHECK(rotations.is_contiguous() && rotations.scalar_type() == at::kFloat &&
              rotations.numel() == x.size(0) * x.size(2), "rotations: [T, 1, head_dim / 2, 2] float32");
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const int64_t stride_t = x.stride(0), stride_h = x.stride(1);
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch_float_type(x.scalar_type(), "rotary", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const T* base = ptr<T>(x);
    T* dst = ptr<T>(out);
    const float* cos_sin = rotations.data_ptr<float>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cs = cos_sin + t * head_dim;  // (cos, sin) per pair: the same layout as x's pairs
        for (int64_t h = 0; h < heads; ++h) {
          const T* row = base + t * stride_t + h * stride_h;
          T* rotated = dst + (t * heads + h) * head_dim;
          int64_t i = 0;
          for (; i + LANES <= head_dim; i += LANES) {
            const floatv v = load(row + i), r = load(cs + i);
            intv even, odd;
            for (int64_t l = 0; l < LANES; ++l) {
              even[l] = static_cast<int32_t>(l & ~1);
              odd[l] = static_cast<int32_t>(l | 1);
            }
            const floatv x0 = __builtin_shuffle(v, even), x1 = __builtin_shuffle(v, odd);
            const floatv cos = __builtin_shuffle(r, even), sin = __builtin_shuffle(r, odd);
            intv lane;
            for (int64_t l = 0; l < LANES; ++l) lane[l] = static_cast<int32_t>(l & 1);
            // lane 2p: x0 cos - x1 sin; lane 2p + 1: x0 sin + x1 cos
            store(rotated + i, lane ? x0 * sin + x1 * cos : x0 * cos - x1 * sin);
          }
          for (; i < head_dim; i += 2) {
            const float x0 = static_cast<float>(row[i]), x1 = static_cast<float>(row[i + 1]);
            rotated[i] = static_cast<T>(x0 * cs[i] - x1 * cs[i + 1]);
            rotated[i + 1] = static_cast<T>(x0 * cs[i + 1] + x1 * cs[i]);
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(inferno, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
}
