// The packed chunks of a prefill attention call and its work items (prefill_attention.cpp and, with AVX512-BF16,
// prefill_attention_bf16.h): a chunk's rows in the packed batch, its block table, its own K/V as computed, and
// its blocks of kQueryBlock query positions in the order the threads take them. Internal linkage.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kQueryBlock = 64;  // query positions per work item (times the group's heads: rows)

// f(std::integral_constant<int64_t, BLOCK>{}, i) for i = 0, BLOCK, ... while a whole block fits in `count`, then
// f(std::integral_constant<int64_t, 1>{}, i) for each of the rest: the micro-kernels' blocking
template <int64_t BLOCK, typename F>
inline void in_blocks(int64_t count, F&& f) {
  int64_t i = 0;
  for (; i + BLOCK <= count; i += BLOCK) f(std::integral_constant<int64_t, BLOCK>{}, i);
  for (; i < count; ++i) f(std::integral_constant<int64_t, 1>{}, i);
}

// The cache offset of key t of kv head h
inline int64_t key_offset(const int64_t* table, int64_t h, int64_t t, int64_t num_blocks, int64_t block_size,
                          int64_t head_dim) {
  return ((h * num_blocks + table[t / block_size]) * block_size + t % block_size) * head_dim;
}

// The chunk's own K/V as computed, [n, KVH, D] with its strides: keys from `first` on are read here, not from the
// cache (which holds them rounded to the cache's dtype, float16 under a float32 model)
template <typename T>
struct ChunkKV {
  const T* k;
  const T* v;
  int64_t k_stride_t, k_stride_h, v_stride_t, v_stride_h, first;

  const T* key(int64_t t, int64_t h) const { return k + (t - first) * k_stride_t + h * k_stride_h; }
  const T* value(int64_t t, int64_t h) const { return v + (t - first) * v_stride_t + h * v_stride_h; }
};

// One chunk of the packed batch: rows [start, start + n) of q, k, v and the output, `num_computed` tokens cached
// before it, its block table
struct Chunk {
  int64_t start, n, num_computed;
  const int64_t* table;
};

// A work item's chunk and block of query positions, and the keys it visits (its cost)
struct QueryBlock {
  int64_t chunk, first, keys;
};

// Every chunk's blocks of kQueryBlock positions, costliest first (the order in which the threads take them)
inline std::vector<QueryBlock> query_blocks(const std::vector<Chunk>& chunks, int64_t window) {
  std::vector<QueryBlock> blocks;
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c)
    for (int64_t first = 0; first < chunks[c].n; first += kQueryBlock) {
      const int64_t first_pos = chunks[c].num_computed + first;
      const int64_t end = first_pos + std::min(kQueryBlock, chunks[c].n - first);
      const int64_t begin = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      blocks.push_back({c, first, end - begin});
    }
  std::stable_sort(blocks.begin(), blocks.end(), [](const QueryBlock& a, const QueryBlock& b) {
    return a.keys > b.keys;
  });
  return blocks;
}

}  // namespace
