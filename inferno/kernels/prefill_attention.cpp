// Prefill attention over a paged KV cache on the CPU: the queries of a step's prompt chunks, packed one after another
// (variable length, as the Triton kernel takes them), each against the keys before it, causal, optionally limited to
// a sliding window: the context already cached, read through the chunk's block table in place, and the chunk's own
// K/V as computed (exact, where the cache rounds them: float16 under a float32 model). One call takes every chunk of
// a step: a step of many short prompts (embeddings) is one parallel region per layer, not one per prompt.
// Registered as `inferno::paged_prefill_attention`.
//
// Flash attention: a work item is (chunk, kv head, block of kQueryBlock positions) with every query head of the group
// as rows; it walks the keys in tiles of kKeyTile, keeps each row's running max, softmax denominator and unnormalised
// output, and rescales them when the max grows, so no score matrix is ever whole. Per tile the keys are converted
// once to float32 and transposed (keys in lanes), and both products are register-blocked micro-kernels: scores
// [rows x keys] = queries x keys^T with the query value broadcast against a vector of keys, and output [rows x D]
// += probabilities x values with a probability broadcast against a vector of a value row. Items are taken from a
// shared counter, costliest (most keys) first, so that the threads finish together.
//
// bfloat16 queries and caches on a CPU with AVX512-BF16 take the same steps with `vdpbf16ps` (two bfloat16 products
// added into each float32 lane: half the instructions): keys as pairs of dimensions, values as pairs of keys, the
// probabilities rounded to bfloat16 for their product with the values (as GPU flash attention does); scores, softmax
// and sums in float32.
#include "entry_points.h"
#include "float_vectors.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kQueryBlock = 64;         // query positions per work item (times the group's heads: rows)
constexpr int64_t kTileVectors = 2;         // score vectors per row of a key tile
constexpr int64_t kKeyTile = kTileVectors * LANES;
constexpr int64_t kScoreRows = LANES == 16 ? 6 : 4;   // rows per score micro-kernel (x kTileVectors accumulators)
constexpr int64_t kOutputRows = LANES == 16 ? 4 : 2;  // rows x kOutputChunks accumulators per output micro-kernel
constexpr int64_t kOutputChunks = 4;

// f(std::integral_constant<int64_t, BLOCK>{}, i) for i = 0, BLOCK, ... while a whole block fits in `count`, then
// f(std::integral_constant<int64_t, 1>{}, i) for each of the rest: the micro-kernels' row and chunk blocking
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

// scores[r, :] = q_r . keys for ROWS rows: one broadcast query value against each vector of keys per dimension
template <int64_t ROWS>
inline void score_rows(const float* q, const float* keys_t, float* scores, int64_t head_dim) {
  floatv acc[ROWS][kTileVectors] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    floatv k[kTileVectors];
    for (int64_t v = 0; v < kTileVectors; ++v) k[v] = load(keys_t + d * kKeyTile + v * LANES);
    for (int64_t r = 0; r < ROWS; ++r) {
      const floatv x = splat(q[r * head_dim + d]);
      for (int64_t v = 0; v < kTileVectors; ++v) acc[r][v] += x * k[v];
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t v = 0; v < kTileVectors; ++v) store(scores + r * kKeyTile + v * LANES, acc[r][v]);
}

// out[r, c0:c0+CHUNKS] += sum_j p[r, j] values[j, c0:c0+CHUNKS] for ROWS rows, over the `keys` live keys
template <int64_t ROWS, int64_t CHUNKS>
inline void weigh_rows(const float* p, const float* values, float* out, int64_t keys, int64_t head_dim, int64_t c0) {
  floatv acc[ROWS][CHUNKS];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t c = 0; c < CHUNKS; ++c) acc[r][c] = load(out + r * head_dim + (c0 + c) * LANES);
  for (int64_t j = 0; j < keys; ++j) {
    floatv v[CHUNKS];
    for (int64_t c = 0; c < CHUNKS; ++c) v[c] = load(values + j * head_dim + (c0 + c) * LANES);
    for (int64_t r = 0; r < ROWS; ++r) {
      const floatv x = splat(p[r * kKeyTile + j]);
      for (int64_t c = 0; c < CHUNKS; ++c) acc[r][c] += x * v[c];
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t c = 0; c < CHUNKS; ++c) store(out + r * head_dim + (c0 + c) * LANES, acc[r][c]);
}

// One key tile as float32 (keys transposed: keys in lanes; values as rows) and the item's queries, scaled.
template <typename C>
struct FloatTile {
  int64_t head_dim;
  std::vector<float> keys, values, q;  // [head_dim][kKeyTile], [kKeyTile][head_dim], [rows][head_dim]

  explicit FloatTile(int64_t head_dim) : head_dim(head_dim), keys(head_dim * kKeyTile), values(kKeyTile * head_dim) {}

  // rows of `group` heads per position, `stride` apart; returns the factor the scores still need
  template <typename T>
  float set_queries(const T* src, int64_t positions, int64_t stride, int64_t group, float scale) {
    q.resize(positions * group * head_dim);
    for (int64_t i = 0; i < positions; ++i)
      for (int64_t x = 0; x < group * head_dim; ++x)
        q[i * group * head_dim + x] = static_cast<float>(src[i * stride + x]) * scale;
    return 1.f;
  }

  template <typename S>
  void load_key(const S* k_row, const S* v_row, int64_t j) {
    for (int64_t c = 0; c < head_dim; c += LANES) {
      store(values.data() + j * head_dim + c, load(v_row + c));
      const floatv k = load(k_row + c);
      for (int64_t i = 0; i < LANES; ++i) keys[(c + i) * kKeyTile + j] = k[i];
    }
  }

  // keys [t0, t0 + kKeyTile) of kv head h: cached context from the cache, the chunk's own as computed; those at or
  // past `end` read as zeros (their -inf scores never weigh)
  template <typename T>
  void load_keys(const C* k_cache, const C* v_cache, const int64_t* table, int64_t h, int64_t t0, int64_t end,
                 int64_t num_blocks, int64_t block_size, const ChunkKV<T>& chunk) {
    std::fill(keys.begin(), keys.end(), 0.f);
    for (int64_t j = 0; j < kKeyTile; ++j) {
      const int64_t t = t0 + j;
      if (t >= end) {
        std::fill(values.data() + j * head_dim, values.data() + (j + 1) * head_dim, 0.f);
      } else if (t >= chunk.first) {
        load_key(chunk.key(t, h), chunk.value(t, h), j);
      } else {
        const int64_t offset = key_offset(table, h, t, num_blocks, block_size, head_dim);
        load_key(k_cache + offset, v_cache + offset, j);
      }
    }
  }

  void score(int64_t rows, float* scores) const {
    in_blocks<kScoreRows>(rows, [&](auto n, int64_t r) {
      score_rows<decltype(n)::value>(q.data() + r * head_dim, keys.data(), scores + r * kKeyTile, head_dim);
    });
  }

  // out[r] += p[r] . values for every row over the `live` keys (p: probabilities [rows][kKeyTile])
  void weigh(int64_t rows, const float* p, float* out, int64_t live) const {
    in_blocks<kOutputRows>(rows, [&](auto n, int64_t r) {
      in_blocks<kOutputChunks>(head_dim / LANES, [&](auto chunks, int64_t c) {
        weigh_rows<decltype(n)::value, decltype(chunks)::value>(p + r * kKeyTile, values.data(), out + r * head_dim,
                                                                live, head_dim, c);
      });
    });
  }
};

#if defined(__AVX512BF16__)
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

  // the chunk's keys from the cache too: a bfloat16 cache holds them exactly as computed
  void load_keys(const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int64_t* table, int64_t h,
                 int64_t t0, int64_t end, int64_t num_blocks, int64_t block_size, const ChunkKV<c10::BFloat16>&) {
    const int64_t pairs = head_dim / 2;
    for (int64_t j = 0; j < kKeyTile; ++j) {
      const bool live = t0 + j < end;
      const int64_t offset = live ? key_offset(table, h, t0 + j, num_blocks, block_size, head_dim) : 0;
      const uint32_t* k_row = reinterpret_cast<const uint32_t*>(k_cache + offset);
      const uint16_t* v_row = reinterpret_cast<const uint16_t*>(v_cache + offset);
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
#endif

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

// T: the queries' and output's dtype; C: the caches'; Tile: FloatTile<C> or Bf16Tile. q rows `q_stride` apart (the
// heads of a position contiguous); k, v: the packed chunks' own K/V, `kv` with its strides and first = 0.
template <typename Tile, typename T, typename C>
void prefill_kernel(const T* q, int64_t q_stride, const ChunkKV<T>& kv, const C* k_cache, const C* v_cache,
                    const std::vector<Chunk>& chunks, T* out, int64_t num_heads, int64_t num_kv_heads,
                    int64_t num_blocks, int64_t block_size, int64_t head_dim, float scale, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  const std::vector<QueryBlock> blocks = query_blocks(chunks, window);
  const int64_t items = static_cast<int64_t>(blocks.size()) * num_kv_heads;
  std::atomic<int64_t> next{0};
  inferno::parallel_for(0, std::min<int64_t>(inferno::num_threads(), items), 1, [&](int64_t, int64_t) {
    Tile tile(head_dim);
    Rows rows;
    for (int64_t item; (item = next.fetch_add(1)) < items;) {
      const QueryBlock& block = blocks[item / num_kv_heads];
      const Chunk& c = chunks[block.chunk];
      const int64_t h = item % num_kv_heads, first = block.first;
      const int64_t count = std::min(kQueryBlock, c.n - first), num_rows = count * group;
      // the chunk's own keys from its first position on, read where it starts in the packed k, v
      const ChunkKV<T> chunk{kv.k + c.start * kv.k_stride_t, kv.v + c.start * kv.v_stride_t, kv.k_stride_t,
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
        T* dst = out + ((c.start + first + i) * num_heads + h * group) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = i * group + g;
          const float inv = 1.f / rows.denom[r];
          for (int64_t d = 0; d < head_dim; ++d)
            dst[g * head_dim + d] = static_cast<T>(rows.out[r * head_dim + d] * inv);
        }
      }
    }
  });
}

// The non-empty chunks of query_start [S + 1] (row offsets) and seq_lens [S] (tokens cached before each chunk plus
// its own), each with its row of block_tables [S, W]; ops.cpp checked them
std::vector<Chunk> packed_chunks(const inferno::View& query_start, const inferno::View& seq_lens,
                                 const inferno::View& block_tables) {
  const int64_t *starts = query_start.data_ptr<int64_t>(), *lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  std::vector<Chunk> chunks;
  for (int64_t c = 0; c < seq_lens.size(0); ++c) {
    const int64_t n = starts[c + 1] - starts[c];
    if (n) chunks.push_back({starts[c], n, lens[c] - n, tables + c * block_tables.stride(0)});
  }
  return chunks;
}

}  // namespace

namespace inferno::cpu {

void paged_prefill_attention(const View& q, const View& k, const View& v, const View& k_cache, const View& v_cache,
                             const View& block_tables, const View& query_start, const View& seq_lens, double scale,
                             int64_t window, const View& out) {
  const std::vector<Chunk> chunks = packed_chunks(query_start, seq_lens, block_tables);
  if (chunks.empty()) return;
  dispatch_query_and_cache(q.scalar_type(), k_cache.scalar_type(), [&](auto* type, auto* cache_type) {
    using T = std::remove_pointer_t<decltype(type)>;
    using C = std::remove_pointer_t<decltype(cache_type)>;
#if defined(__AVX512BF16__)
    using Tile = std::conditional_t<std::is_same_v<C, c10::BFloat16>, Bf16Tile, FloatTile<C>>;
#else
    using Tile = FloatTile<C>;
#endif
    const ChunkKV<T> kv{k.data_ptr<T>(), v.data_ptr<T>(), k.stride(0), k.stride(1), v.stride(0), v.stride(1), 0};
    prefill_kernel<Tile, T, C>(q.data_ptr<T>(), q.stride(0), kv, k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), chunks,
                               out.data_ptr<T>(), q.size(1), k_cache.size(0), k_cache.size(1), k_cache.size(2),
                               q.size(2), static_cast<float>(scale), window);
  });
}

}  // namespace inferno::cpu
