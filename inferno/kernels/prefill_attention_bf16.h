// Prefill attention for bfloat16 queries and caches on a CPU with AVX512-BF16 (prefill_attention.cpp's float32
// kernel otherwise): a work item (chunk, kv head, block of kQueryBlock positions) has every query head of the group
// as rows and walks the keys in tiles of kKeyTile with `vdpbf16ps` (two bfloat16 products added into each float32
// lane: half the instructions): keys as pairs of dimensions, values as pairs of keys, the probabilities rounded to
// bfloat16 for their product with the values (as GPU flash attention does); scores, the online softmax (each row's
// running max, denominator and unnormalised output, rescaled when the max grows) and sums in float32.
#pragma once

#include "float_vectors.h"
#include "prefill_chunks.h"

#include <atomic>
#include <cmath>
#include <vector>

namespace {
namespace bf16 {

constexpr int64_t kTileVectors = 2;  // score vectors per row of a key tile
constexpr int64_t kKeyTile = kTileVectors * LANES;
constexpr int64_t kScoreRows = 6;    // rows per score micro-kernel (x kTileVectors accumulators)
constexpr int64_t kOutputRows = 4;   // rows x kOutputChunks accumulators per output micro-kernel
constexpr int64_t kOutputChunks = 4;

// scores[r, :] = q_r . keys for ROWS rows, two dimensions per instruction: a broadcast (q[2i], q[2i+1]) against
// the vectors of (k[2i], k[2i+1]) pairs
template <int64_t ROWS>
inline void score_rows_bf16(const uint32_t* q, const uint32_t* keys, float* scores, int64_t pairs) {
  __m512 acc[ROWS][kTileVectors];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t v = 0; v < kTileVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh k[kTileVectors];
    for (int64_t v = 0; v < kTileVectors; ++v) k[v] = (__m512bh)_mm512_loadu_si512(keys + i * kKeyTile + v * LANES);
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * pairs + i]));
      for (int64_t v = 0; v < kTileVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, k[v]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t v = 0; v < kTileVectors; ++v) _mm512_storeu_ps(scores + r * kKeyTile + v * LANES, acc[r][v]);
}

// out[r, c0:c0+CHUNKS] += sum_j p[r, j] values[j, c0:c0+CHUNKS], two keys per instruction: a broadcast
// (p[2j], p[2j+1]) against the vectors of (v[2j], v[2j+1]) pairs
template <int64_t ROWS, int64_t CHUNKS>
inline void weigh_rows_bf16(const uint32_t* p, const uint32_t* values, float* out, int64_t key_pairs,
                            int64_t head_dim, int64_t c0) {
  __m512 acc[ROWS][CHUNKS];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t c = 0; c < CHUNKS; ++c) acc[r][c] = _mm512_loadu_ps(out + r * head_dim + (c0 + c) * LANES);
  for (int64_t j = 0; j < key_pairs; ++j) {
    __m512bh v[CHUNKS];
    for (int64_t c = 0; c < CHUNKS; ++c) v[c] = (__m512bh)_mm512_loadu_si512(values + j * head_dim + (c0 + c) * LANES);
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r * kKeyTile / 2 + j]));
      for (int64_t c = 0; c < CHUNKS; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, v[c]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(out + r * head_dim + (c0 + c) * LANES, acc[r][c]);
}

// One key tile in bfloat16 pairs: keys [head_dim / 2][kKeyTile] (dimensions 2i, 2i+1 of a key in one 32-bit lane),
// values [kKeyTile / 2][head_dim] (keys 2j, 2j+1 of a dimension in one lane); the queries as they are, in pairs.
struct Bf16Tile {
  int64_t head_dim;
  std::vector<uint32_t> keys, values, q, p;  // ..., [rows][head_dim / 2], probabilities [rows][kKeyTile / 2]

  explicit Bf16Tile(int64_t head_dim)
      : head_dim(head_dim), keys(head_dim / 2 * kKeyTile), values(kKeyTile / 2 * head_dim) {}

  float set_queries(const c10::BFloat16* src, int64_t positions, int64_t stride, int64_t group, float scale) {
    const int64_t row = group * head_dim / 2;  // one position's rows, in pairs
    q.resize(positions * row);
    for (int64_t i = 0; i < positions; ++i) std::memcpy(q.data() + i * row, src + i * stride, row * sizeof(uint32_t));
    return scale;  // exact products of the bfloat16 values, scaled after
  }

  // the cached context from the cache, the chunk's own keys from `chunk` (a chunk whose K/V no later step reads,
  // an embedding's, is never written to the cache)
  void load_keys(const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int64_t* table, int64_t h,
                 int64_t t0, int64_t end, int64_t num_blocks, int64_t block_size, const ChunkKV<c10::BFloat16>& chunk) {
    const int64_t pairs = head_dim / 2;
    for (int64_t j = 0; j < kKeyTile; ++j) {
      const int64_t t = t0 + j;
      const bool live = t < end, cached = t < chunk.first;
      const int64_t offset = live && cached ? key_offset(table, h, t, num_blocks, block_size, head_dim) : 0;
      const c10::BFloat16* k_src = live && !cached ? chunk.key(t, h) : k_cache + offset;
      const c10::BFloat16* v_src = live && !cached ? chunk.value(t, h) : v_cache + offset;
      const uint32_t* k_row = reinterpret_cast<const uint32_t*>(k_src);
      const uint16_t* v_row = reinterpret_cast<const uint16_t*>(v_src);
      uint16_t* v_dst = reinterpret_cast<uint16_t*>(values.data() + (j / 2) * head_dim) + j % 2;
      for (int64_t i = 0; i < pairs; ++i) keys[i * kKeyTile + j] = live ? k_row[i] : 0u;
      for (int64_t d = 0; d < head_dim; ++d) v_dst[2 * d] = live ? v_row[d] : 0;
    }
  }

  void score(int64_t rows, float* scores) const {
    const int64_t pairs = head_dim / 2;
    in_blocks<kScoreRows>(rows, [&](auto n, int64_t r) {
      score_rows_bf16<decltype(n)::value>(q.data() + r * pairs, keys.data(), scores + r * kKeyTile, pairs);
    });
  }

  void weigh(int64_t rows, const float* probabilities, float* out, int64_t live) {
    p.resize(rows * kKeyTile / 2);
    for (int64_t r = 0; r < rows; ++r) {  // the probabilities rounded to bfloat16, in key order
      const float* src = probabilities + r * kKeyTile;
      const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + LANES), _mm512_loadu_ps(src));
      _mm512_storeu_si512(p.data() + r * kKeyTile / 2, (__m512i)pair);
    }
    const int64_t key_pairs = (live + 1) / 2;
    in_blocks<kOutputRows>(rows, [&](auto n, int64_t r) {
      in_blocks<kOutputChunks>(head_dim / LANES, [&](auto chunks, int64_t c) {
        weigh_rows_bf16<decltype(n)::value, decltype(chunks)::value>(p.data() + r * kKeyTile / 2, values.data(),
                                                                     out + r * head_dim, key_pairs, head_dim, c);
      });
    });
  }
};
struct Rows {  // one work item's rows: row r is position first + r / group, query head h * group + r % group
  std::vector<float> out, scores;  // [rows][head_dim], [rows][kKeyTile]
  std::vector<float> max, denom;   // [rows]
};

// Online softmax over one tile for row r (position `pos`): scale, mask, new max, rescale, probabilities in place.
inline void softmax_row(Rows& rows, int64_t r, int64_t pos, int64_t t0, int64_t window, float scale,
                        int64_t head_dim) {
  float* s = rows.scores.data() + r * kKeyTile;
  if (scale != 1.f)
    for (int64_t v = 0; v < kTileVectors; ++v) store(s + v * LANES, load(s + v * LANES) * scale);
  const int64_t lo = window > 0 ? pos - window + 1 : 0;  // keys [lo, pos] are visible
  if (t0 < lo || t0 + kKeyTile - 1 > pos)
    for (int64_t j = 0; j < kKeyTile; ++j)
      if (t0 + j < lo || t0 + j > pos) s[j] = kNegInf;
  floatv m = load(s);
  for (int64_t v = 1; v < kTileVectors; ++v) {
    const floatv x = load(s + v * LANES);
    m = x > m ? x : m;
  }
  const float tile_max = max_lanes(m);
  if (tile_max == kNegInf) {  // nothing visible in this tile
    std::fill(s, s + kKeyTile, 0.f);
    return;
  }
  const float old_max = rows.max[r], new_max = std::max(old_max, tile_max);
  floatv sum{};
  for (int64_t v = 0; v < kTileVectors; ++v) {
    const floatv p = exp_lanes(load(s + v * LANES) - new_max);
    store(s + v * LANES, p);
    sum += p;
  }
  if (new_max > old_max) {
    const float alpha = old_max == kNegInf ? 0.f : std::exp(old_max - new_max);
    rows.denom[r] *= alpha;
    float* o = rows.out.data() + r * head_dim;
    for (int64_t c = 0; c < head_dim; c += LANES) store(o + c, load(o + c) * alpha);
    rows.max[r] = new_max;
  }
  rows.denom[r] += sum_lanes(sum);
}

// q rows `q_stride` apart (the heads of a position contiguous); k, v: the packed chunks' own K/V, `kv` with its
// strides and first = 0
void prefill_kernel(const c10::BFloat16* q, int64_t q_stride, const ChunkKV<c10::BFloat16>& kv,
                    const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const std::vector<Chunk>& chunks,
                    c10::BFloat16* out, int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                    int64_t block_size, int64_t head_dim, float scale, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  const std::vector<QueryBlock> blocks = query_blocks(chunks, window);
  const int64_t items = static_cast<int64_t>(blocks.size()) * num_kv_heads;
  std::atomic<int64_t> next{0};
  inferno::parallel_for(0, std::min<int64_t>(inferno::num_threads(), items), 1, [&](int64_t, int64_t) {
    Bf16Tile tile(head_dim);
    Rows rows;
    for (int64_t item; (item = next.fetch_add(1)) < items;) {
      const QueryBlock& block = blocks[item / num_kv_heads];
      const Chunk& c = chunks[block.chunk];
      const int64_t h = item % num_kv_heads, first = block.first;
      const int64_t count = std::min(kQueryBlock, c.n - first), num_rows = count * group;
      // the chunk's own keys from its first position on, read where it starts in the packed k, v
      const ChunkKV<c10::BFloat16> chunk{kv.k + c.start * kv.k_stride_t, kv.v + c.start * kv.v_stride_t, kv.k_stride_t,
                             kv.k_stride_h, kv.v_stride_t, kv.v_stride_h, c.num_computed};
      // the group's heads of a position are adjacent in q
      const float score_scale = tile.set_queries(q + (c.start + first) * q_stride + h * group * head_dim, count,
                                                 q_stride, group, scale);
      rows.out.assign(num_rows * head_dim, 0.f);
      rows.scores.resize(num_rows * kKeyTile);
      rows.max.assign(num_rows, kNegInf);
      rows.denom.assign(num_rows, 0.f);
      const int64_t first_pos = c.num_computed + first, end = first_pos + count;  // keys [.., end) are needed
      const int64_t begin = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      for (int64_t t0 = begin; t0 < end; t0 += kKeyTile) {
        tile.load_keys(k_cache, v_cache, c.table, h, t0, end, num_blocks, block_size, chunk);
        tile.score(num_rows, rows.scores.data());
        for (int64_t r = 0; r < num_rows; ++r)
          softmax_row(rows, r, first_pos + r / group, t0, window, score_scale, head_dim);
        tile.weigh(num_rows, rows.scores.data(), rows.out.data(), std::min(kKeyTile, end - t0));
      }
      for (int64_t i = 0; i < count; ++i) {
        c10::BFloat16* dst = out + ((c.start + first + i) * num_heads + h * group) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = i * group + g;
          const float inv = 1.f / rows.denom[r];
          for (int64_t d = 0; d < head_dim; ++d)
            dst[g * head_dim + d] = static_cast<c10::BFloat16>(rows.out[r * head_dim + d] * inv);
        }
      }
    }
  });
}

}  // namespace bf16
}  // namespace
