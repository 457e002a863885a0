"""The CPU's peak rate of int8 products on 256-bit vectors, the ceiling of the AVX2 tile kernels: a register-only
loop of 8 independent chains per thread (the compiler is told that the operands may change every iteration), each
instruction 32 multiply-adds of unsigned by signed bytes, as
- `vpmaddubsw` + `vpaddw` (16-bit sums: the int4 and Q4_K tiles without VNNI),
- `vpmaddubsw` + `vpmaddwd` + `vpaddd` (widened every vector: the Q8 and Q6_K tiles without VNNI),
- `vpdpbusd` (AVX-VNNI, where the CPU has it).
Prints GMAC/s on --threads threads (nothing written: the AVX2 sections of RESULTS.md quote it).

    python int8_peak.py --threads 2
"""
import argparse

from torch.utils import cpp_extension

from inferno.cpu_features import cpu_flags

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

double gmacs(int64_t variant, int64_t iterations, int64_t threads) {
  const double start = omp_get_wtime();
  long long sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m256i w = _mm256_set1_epi8(3 + omp_get_thread_num()), x = _mm256_set1_epi8(7), acc[8];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t it = 0; it < iterations; ++it) {
      asm volatile("" : "+x"(w), "+x"(x));  // the operands may change: nothing is hoisted, nothing waits
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        if (variant == 0) acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(w, x));
        else if (variant == 1) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
#if defined(__AVXVNNI__)
        else acc[i] = _mm256_dpbusd_avx_epi32(acc[i], w, x);
#endif
      }
    }
    for (int i = 0; i < 8; ++i) sink += _mm256_extract_epi32(acc[i], 0);
  }
  const double seconds = omp_get_wtime() - start;
  return sink == 42 ? 0.0 : 8.0 * 32 * iterations * threads / seconds / 1e9;
}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iterations", type=int, default=50_000_000)
    args = p.parse_args()
    vnni = "avx_vnni" in cpu_flags()  # (INFERNO_CPU_ISA=avx2 leaves it out)
    module = cpp_extension.load_inline("inferno_int8_peak", cpp_sources=SOURCE, functions=["gmacs"],
                                       extra_cflags=["-O2", "-mavx2", "-fopenmp", *(["-mavxvnni"] if vnni else [])],
                                       extra_ldflags=["-fopenmp"])
    names = ["vpmaddubsw + vpaddw", "vpmaddubsw + vpmaddwd + vpaddd", "vpdpbusd (AVX-VNNI)"]
    for variant, name in enumerate(names if vnni else names[:2]):
        rates = sorted(module.gmacs(variant, args.iterations, args.threads) for _ in range(3))
        print(f"{name}: {rates[1]:.0f} GMAC/s on {args.threads} threads (median of 3)")


if __name__ == "__main__":
    main()
