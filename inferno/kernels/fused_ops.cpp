// The decoder's elementwise steps fused on the CPU, one pass over each row instead of one PyTorch operator (and one
// temporary) per step, for eager and compiled steps alike (the same rounding in both): the CPU twins of
// kernels/triton_fused.py. Registered as `inferno::rms_norm`, `inferno::add_rms_norm` (the residual added first),
// `inferno::silu_and_mul` and `inferno::rotary` (ops.cpp). float32, bfloat16 and float16 rows; arithmetic in float32, rounded
// once to the row's dtype, except where the PyTorch path rounds in between and the result must stay the same (see
// rms_norm).
#include "entry_points.h"
#include "float_vectors.h"

#include <cmath>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline T* ptr(const inferno::View& t) { return t.data_ptr<T>(); }

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
  inferno::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
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

}  // namespace

namespace inferno::cpu {

void rms_norm(const View& x, const View& weight, double eps, const View& out) {
  dispatch_float_type(x.scalar_type(), [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    rms_norm_rows<T>(ptr<T>(x), nullptr, ptr<T>(weight), ptr<T>(out), nullptr, x.size(0), x.size(1),
                     static_cast<float>(eps));
  });
}

void add_rms_norm(const View& x, const View& residual, const View& weight, double eps, const View& out,
                  const View& sum) {
  dispatch_float_type(x.scalar_type(), [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    rms_norm_rows<T>(ptr<T>(x), ptr<T>(residual), ptr<T>(weight), ptr<T>(out), ptr<T>(sum), x.size(0), x.size(1),
                     static_cast<float>(eps));
  });
}

}  // namespace inferno::cpu

namespace {

// silu(g) = g / (1 + exp(-g)), with e = exp(-|g|) <= 1: g / (1 + e) for g >= 0, g e / (1 + e) below
inline floatv silu(floatv g) {
  const floatv magnitude = g < 0.f ? -g : g;
  const floatv e = exp_lanes(-magnitude);
  return (g < 0.f ? g * e : g) / (1.f + e);
}

}  // namespace

namespace inferno::cpu {

void silu_and_mul(const View& gate_up, const View& out) {
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  dispatch_float_type(gate_up.scalar_type(), [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const T* src = ptr<T>(gate_up);
    T* dst = ptr<T>(out);
    parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
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
}

// (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos) for each interleaved pair of x's rows
void rotary(const View& x, const View& rotations, const View& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const int64_t stride_t = x.stride(0), stride_h = x.stride(1);
  dispatch_float_type(x.scalar_type(), [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const T* base = ptr<T>(x);
    T* dst = ptr<T>(out);
    const float* cos_sin = rotations.data_ptr<float>();
    parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
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
}

}  // namespace inferno::cpu
