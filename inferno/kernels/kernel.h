// What every kernel file includes: the parts of PyTorch the kernels use (tensors, at::empty, at::parallel_for and
// TORCH_LIBRARY_IMPL; torch/extension.h would add pybind11 and the whole C++ API, four times the compile time of a
// kernel file), and the x86 intrinsics where the target is x86. Code under the ISA macros (__AVX2__, __AVX512F__,
// __AVX512VNNI__, __AVXVNNI__, __AVX512BF16__, __F16C__, __SSE2__) may use intrinsics; code outside them is the
// portable reference that builds on any architecture (the `scalar` level).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
