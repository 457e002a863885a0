// GGUF quantized blocks repacked at load time, row by row in parallel, into the forms the kernels run (the same
// results, bit for bit, as the vectorised PyTorch path of inferno/loader/gguf_blocks.py):
//
// 1. `gguf_to_int4`: Q4_0 / Q4_1 rows [N, bytes per row] -> the int4 kernel's rows (see the int4 layout in
//    quantized_gemv.cpp), written into a given tensor: codes in chunks of 16 blocks of 32, then a float16 scale and
//    a float16 min per group of 32 (Q4_0: min = -8 d), exact. (Q4_K runs as stored: q4_k_gemv.cpp.)
// 2. `gguf_to_q8`: Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 rows -> Q8Groups' signed int8 codes
//    [N, K], float32 scales [N, K / G] and mins [N, K / G] (an empty tensor for the symmetric types), G = 16 for
//    Q6_K, else 32.
// (`gguf_string_offsets`, a walk over a metadata array's strings, is in ops.cpp.)
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "quantized_rows.h"

namespace {

using namespace inferno::gguf;

constexpr int64_t CHUNK_BLOCKS = 16;  // blocks of 32 per chunk of the int4 layout
// At least this many output bytes per parallel task: a small tensor is repacked on the calling thread (a parallel
// region costs more than it saves there, far more when other processes hold the cores).
constexpr int64_t TASK_BYTES = 1 << 18;

inline int64_t row_grain(int64_t row_bytes) {
  return std::max<int64_t>(1, TASK_BYTES / std::max<int64_t>(1, row_bytes));
}

inline void store_half(uint8_t* p, float v) {
  const uint16_t bits = c10::Half(v).x;
  std::memcpy(p, &bits, sizeof(bits));
}

// Asks for transparent huge pages under the 2 MiB-aligned interior of `bytes` at `p`, an output about to be written
// for the first time: one page fault per 2 MiB instead of per 4 KiB (Qwen2.5-1.5B's int4 rows: 5.2 vs 2.9 ms per
// 8960 x 1536 matrix, one thread). Where the kernel does not allow them, nothing changes.
inline void advise_huge_pages(void* p, int64_t bytes) {
#if defined(MADV_HUGEPAGE)
  constexpr uintptr_t HUGE_PAGE = uintptr_t{1} << 21;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(HUGE_PAGE - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

}  // namespace

namespace inferno::cpu {

// ---- 1. the int4 layout ----

void gguf_to_int4(const View& raw, int64_t qtype, const View& packed) {
  const gguf::Blocks t = gguf::blocks_of(qtype);
  const int64_t rows = raw.size(0), n = raw.size(1) / t.block_bytes;
  const int64_t k = n * t.block_values, groups = k / 32, blocks = groups, code_bytes = k / 2;
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int64_t src_stride = raw.stride(0), dst_stride = packed.size(1);
  advise_huge_pages(dst, rows * dst_stride);
  parallel_for(0, rows, row_grain(dst_stride), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* in = src + r * src_stride;
      uint8_t* out = dst + r * dst_stride;
      uint8_t* scales = out + code_bytes;
      uint8_t* mins = scales + 2 * groups;
      // block b (of 32 codes) goes to chunk b / 16, place b % 16 among the chunk's nb blocks
      auto chunk_of = [&](int64_t b, int64_t& nb, int64_t& l) {
        const int64_t c = b / CHUNK_BLOCKS;
        nb = std::min(CHUNK_BLOCKS, blocks - c * CHUNK_BLOCKS);
        l = b % CHUNK_BLOCKS;
        return out + c * CHUNK_BLOCKS * 16;
      };
      int64_t nb, l;
      const int64_t header = qtype == Q4_1 ? 4 : 2;
      for (int64_t b = 0; b < n; ++b) {
        const uint8_t* blk = in + b * t.block_bytes;
        uint8_t* chunk = chunk_of(b, nb, l);
        for (int64_t v = 0; v < 4; ++v)  // qs[j] holds codes j and 16 + j already: runs are slices of qs
          std::memcpy(chunk + v * 4 * nb + 4 * l, blk + header + 4 * v, 4);
        std::memcpy(scales + 2 * b, blk, 2);
        if (qtype == Q4_1)
          std::memcpy(mins + 2 * b, blk + 2, 2);
        else
          store_half(mins + 2 * b, -8.f * half_at(blk));
      }
    }
  });
}

// ---- 2. Q8Groups ----

void gguf_to_q8(const View& raw, int64_t qtype, const View& codes, const View& scales, const View& mins) {
  const gguf::Blocks t = gguf::blocks_of(qtype);
  const int64_t rows = raw.size(0), n = raw.size(1) / t.block_bytes;
  const int64_t k = n * t.block_values, group = gguf::q8_group(qtype), groups = k / group;
  const bool has_mins = gguf::q8_has_mins(qtype);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  int8_t* q_out = codes.data_ptr<int8_t>();
  float* s_out = scales.data_ptr<float>();
  float* m_out = has_mins ? mins.data_ptr<float>() : nullptr;
  const int64_t src_stride = raw.stride(0);
  advise_huge_pages(q_out, rows * k);
  parallel_for(0, rows, row_grain(k + 4 * groups * (has_mins ? 2 : 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* in = src + r * src_stride;
      int8_t* q = q_out + r * k;
      float* sc_row = s_out + r * groups;
      float* mn_row = has_mins ? m_out + r * groups : nullptr;
      for (int64_t b = 0; b < n; ++b) {
        const uint8_t* blk = in + b * t.block_bytes;
        int8_t* qb = q + b * t.block_values;
        switch (qtype) {
          case Q8_0:
            std::memcpy(qb, blk + 2, 32);
            sc_row[b] = half_at(blk);
            break;
          case Q4_0:
          case Q4_1:
          case Q5_0:
          case Q5_1: {
            const bool five = qtype == Q5_0 || qtype == Q5_1, with_min = qtype == Q4_1 || qtype == Q5_1;
            const int64_t header = with_min ? 4 : 2;
            const uint8_t* qs = blk + header + (five ? 4 : 0);
            uint32_t qh = 0;
            if (five) std::memcpy(&qh, blk + header, 4);
            const int offset = with_min ? 0 : five ? 16 : 8;
            for (int64_t j = 0; j < 16; ++j) {
              const int lo = (qs[j] & 0x0F) | (five ? ((qh >> j) & 1) << 4 : 0);
              const int hi = (qs[j] >> 4) | (five ? ((qh >> (16 + j)) & 1) << 4 : 0);
              qb[j] = static_cast<int8_t>(lo - offset);  // codes up to 31 fit int8
              qb[16 + j] = static_cast<int8_t>(hi - offset);
            }
            sc_row[b] = half_at(blk);
            if (with_min) mn_row[b] = half_at(blk + 2);
            break;
          }
          case Q4_K:
          case Q5_K: {
            const float d = half_at(blk), dmin = half_at(blk + 2);
            uint8_t sc[8], mn[8];
            k_scales(blk + 4, sc, mn);
            const bool five = qtype == Q5_K;
            const uint8_t* qh = blk + 16;  // Q5_K: bit s of qh[j] is the high bit of code j of sub-block s
            const uint8_t* qs = blk + (five ? 48 : 16);
            for (int64_t p = 0; p < 4; ++p) {
              for (int64_t j = 0; j < 32; ++j) {
                const uint8_t x = qs[32 * p + j];
                int lo = x & 0x0F, hi = x >> 4;
                if (five) {
                  lo |= ((qh[j] >> (2 * p)) & 1) << 4;
                  hi |= ((qh[j] >> (2 * p + 1)) & 1) << 4;
                }
                qb[64 * p + j] = static_cast<int8_t>(lo);
                qb[64 * p + 32 + j] = static_cast<int8_t>(hi);
              }
            }
            for (int64_t j = 0; j < 8; ++j) {
              sc_row[8 * b + j] = d * static_cast<float>(sc[j]);
              mn_row[8 * b + j] = -(dmin * static_cast<float>(mn[j]));
            }
            break;
          }
          case Q6_K: {
            const uint8_t* ql = blk;
            const uint8_t* qh = blk + 128;
            const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
            const float d = half_at(blk + 208);
            for (int64_t h = 0; h < 2; ++h)  // two halves of 128 codes: quarter v takes 2 high bits at 2v
              for (int64_t v = 0; v < 4; ++v)
                for (int64_t j = 0; j < 32; ++j) {
                  const uint8_t l = ql[64 * h + 32 * (v & 1) + j];
                  const int low = v < 2 ? l & 0x0F : l >> 4;
                  const int high = (qh[32 * h + j] >> (2 * v)) & 3;
                  qb[128 * h + 32 * v + j] = static_cast<int8_t>((low | (high << 4)) - 32);
                }
            for (int64_t j = 0; j < 16; ++j) sc_row[16 * b + j] = d * static_cast<float>(sc[j]);
            break;
          }
        }
      }
    }
  });
}

}  // namespace inferno::cpu
