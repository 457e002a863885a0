// What every kernel body includes, and nothing of PyTorch's: ops.cpp alone is torch-facing (the operators' schemas,
// tensor checks, outputs, and the call into the bodies of the ISA level its library was built for), compiled once;
// a body (every other *.cpp here) is plain C++ compiled once per ISA level. A tensor reaches a body as a View
// (pointer, dtype, sizes, strides); threads come from PyTorch's pool through parallel_for. float16 / bfloat16 are
// PyTorch's header-only types (c10::Half, c10::BFloat16: the same rounding as the tensors' own). Code under the ISA
// macros (__AVX2__, __AVX512F__, __AVX512VNNI__, __AVXVNNI__, __AVX512BF16__, __F16C__, __SSE2__) may use intrinsics;
// code outside them is the portable reference that builds on any architecture (the `scalar` level).
#pragma once

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace inferno {

enum class Dtype : int8_t { Float, BFloat16, Half, Byte, Char, Long, Other };

constexpr int64_t kMaxDims = 4;

struct View {  // a tensor as a body reads it; sizes and strides in elements
  void* data = nullptr;
  Dtype dtype = Dtype::Other;
  int64_t dim = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};

  template <typename T>
  T* data_ptr() const { return static_cast<T*>(data); }
  int64_t size(int64_t d) const { return sizes[d]; }
  int64_t stride(int64_t d) const { return strides[d]; }
  Dtype scalar_type() const { return dtype; }
};

// PyTorch's intra-op threads (at::get_num_threads / at::parallel_for, defined in ops.cpp): the same chunks as
// at::parallel_for gives for the same arguments.
int64_t num_threads();
void parallel_for(int64_t begin, int64_t end, int64_t grain, void (*chunk)(const void*, int64_t, int64_t),
                  const void* context);

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  parallel_for(begin, end, grain, [](const void* c, int64_t b, int64_t e) { (*static_cast<const F*>(c))(b, e); }, &f);
}

}  // namespace inferno
