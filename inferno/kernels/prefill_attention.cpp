// Prefill attention over a paged KV cache on the CPU: the queries of a step's prompt chunks, packed one after another
// (variable length, as the Triton kernel takes them), each against the keys before it, causal, optionally limited to
// a sliding window: the context already cached, read through the chunk's block table in place, and the chunk's own
// K/V as computed (exact, where the cache rounds them: float16 under a float32 model). One call takes every chunk of
// a step: a step of many short prompts (embeddings) is one parallel region per layer, not one per prompt.
// Registered as `inferno::paged_prefill_attention`.
//
// Flash attention with the query rows in vector lanes: a work item is (chunk, kv head, block of kQueryBlock
// positions). Its rows (every query head of the group per position) are split into blocks of kRowBlock and
// transposed, so that each lane is one row; its keys and values are gathered as float32 rows, kKeySegment at a
// time, and each block of rows walks them up to its last position in tiles of kKeyTile at fixed key positions,
// keeping each lane's running max, softmax denominator and unnormalised output [head_dim][rows] and rescaling them
// per tile. The softmax is lane-wise vector code (no horizontal max or sum, a polynomial exp), and both products are
// register-blocked micro-kernels that broadcast a key (or value) element against vectors of rows. A row's float
// operations depend only on its position and the keys, never on the other rows of its block, so the result is the
// same however the step packs and chunks prompts. Items are taken from a shared counter, costliest (most keys)
// first, so that the threads finish together.
//
// bfloat16 queries and caches on a CPU with AVX512-BF16 take prefill_attention_bf16.h's `vdpbf16ps` kernel.
#include "entry_points.h"
#include "float_vectors.h"
#include "prefill_chunks.h"

#if defined(__AVX512BF16__)
#include "prefill_attention_bf16.h"
#endif

#include <atomic>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kRowVectors = 3;                   // vectors of rows per row block
constexpr int64_t kRowBlock = kRowVectors * LANES;   // rows per row block, one per lane
constexpr int64_t kKeyTile = 64;                     // keys per softmax step (max and rescale), at multiples of it
constexpr int64_t kKeySegment = 8 * kKeyTile;        // keys gathered as float32 at a time (256 KiB at head_dim 64)
constexpr int64_t kScoreKeys = LANES == 16 ? 8 : 4;  // keys x kRowVectors accumulators per score micro-kernel
constexpr int64_t kValueDims = LANES == 16 ? 8 : 4;  // dimensions x kRowVectors accumulators per output one

inline intv splat_int(int32_t x) { return intv{} + x; }

// *x in every lane, one vbroadcastss from memory (splat's `floatv{} + x` adds 0 to x first)
inline floatv broadcast(const float* x) {
#if defined(__AVX512F__)
  return (floatv)_mm512_set1_ps(*x);
#elif defined(__AVX__)
  return (floatv)_mm256_broadcast_ss(x);
#else
  return splat(*x);
#endif
}

// scores[j, :] = keys[j] . q for KEYS keys against ROWS vectors of rows: per dimension, a broadcast key element
// against each vector of the transposed queries q_t [head_dim][kRowBlock]
template <int64_t KEYS, int64_t ROWS>
inline void score_keys(const float* keys, const float* q_t, float* scores, int64_t head_dim) {
  floatv acc[KEYS][ROWS] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    floatv q[ROWS];
    for (int64_t v = 0; v < ROWS; ++v) q[v] = load(q_t + d * kRowBlock + v * LANES);
    for (int64_t j = 0; j < KEYS; ++j) {
      const floatv k = broadcast(keys + j * head_dim + d);
      for (int64_t v = 0; v < ROWS; ++v) acc[j][v] += k * q[v];
    }
  }
  for (int64_t j = 0; j < KEYS; ++j)
    for (int64_t v = 0; v < ROWS; ++v) store(scores + j * kRowBlock + v * LANES, acc[j][v]);
}

// out_t[i, :] += sum_j p[j, :] values[j, i] for DIMS dimensions over `keys` keys: per key, a broadcast value element
// against each vector of probabilities p [keys][kRowBlock]
template <int64_t DIMS, int64_t ROWS>
inline void weigh_dims(const float* values, const float* p, float* out_t, int64_t keys, int64_t head_dim) {
  floatv acc[DIMS][ROWS];
  for (int64_t i = 0; i < DIMS; ++i)
    for (int64_t v = 0; v < ROWS; ++v) acc[i][v] = load(out_t + i * kRowBlock + v * LANES);
  for (int64_t j = 0; j < keys; ++j) {
    floatv w[ROWS];
    for (int64_t v = 0; v < ROWS; ++v) w[v] = load(p + j * kRowBlock + v * LANES);
    for (int64_t i = 0; i < DIMS; ++i) {
      const floatv x = broadcast(values + j * head_dim + i);
      for (int64_t v = 0; v < ROWS; ++v) acc[i][v] += x * w[v];
    }
  }
  for (int64_t i = 0; i < DIMS; ++i)
    for (int64_t v = 0; v < ROWS; ++v) store(out_t + i * kRowBlock + v * LANES, acc[i][v]);
}

template <typename S>
inline void to_float(const S* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += LANES) store(dst + i, load(src + i));
}

// dst[c * dst_stride + r] = src[r * src_stride + c] for r, c < 8: rows to lanes and back, 8 x 8 at a time
inline void transpose8(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
#if defined(__AVX__)
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
#else
  for (int64_t r = 0; r < 8; ++r)
    for (int64_t c = 0; c < 8; ++c) dst[c * dst_stride + r] = src[r * src_stride + c];
#endif
}

// One block of an item's rows, one per lane: the queries (scaled) and unnormalised output [head_dim][kRowBlock],
// each lane's running max and softmax denominator and its visible keys [lo, hi]; rows [r0, r0 + n) of the item,
// visiting keys [begin, end)
struct RowBlock {
  std::vector<float> q_t, out_t;
  floatv max[kRowVectors], denom[kRowVectors];
  intv lo[kRowVectors], hi[kRowVectors];
  int64_t r0, n, begin, end;

  int64_t vectors() const { return (n + LANES - 1) / LANES; }

  // Online softmax over one tile of scores s [keys][kRowBlock] (keys t0 ..), lane by lane: mask, new max,
  // probabilities in place, the denominator and the output rescaled. A lane that has seen no visible key yet keeps
  // max -inf and weighs zeros.
  template <int64_t ROWS>
  void softmax(float* scores, int64_t t0, int64_t keys, int64_t head_dim) {
    for (int64_t v = 0; v < ROWS; ++v) {
      float* s = scores + v * LANES;
      if (t0 < lo[v][LANES - 1] || t0 + keys - 1 > hi[v][0])  // a key hidden from some lane (positions rise by lane)
        for (int64_t j = 0; j < keys; ++j) {
          const intv t = splat_int(static_cast<int32_t>(t0 + j));
          store(s + j * kRowBlock, (t < lo[v]) | (t > hi[v]) ? splat(kNegInf) : load(s + j * kRowBlock));
        }
      floatv m = max[v];
      for (int64_t j = 0; j < keys; ++j) {
        const floatv x = load(s + j * kRowBlock);
        m = x > m ? x : m;
      }
      const floatv shift = m == kNegInf ? floatv{} : m;
      const floatv alpha = exp_lanes(max[v] - shift);  // 0 for a lane's first visible keys, 1 where the max held
      floatv sum{};
      for (int64_t j = 0; j < keys; ++j) {
        const floatv p = exp_lanes(load(s + j * kRowBlock) - shift);
        store(s + j * kRowBlock, p);
        sum += p;
      }
      denom[v] = denom[v] * alpha + sum;
      max[v] = m;
      for (int64_t d = 0; d < head_dim; ++d) {
        float* o = out_t.data() + d * kRowBlock + v * LANES;
        store(o, load(o) * alpha);
      }
    }
  }
};

// f(std::integral_constant<int64_t, ROWS>{}) for ROWS = `vectors`, 1 to kRowVectors
template <typename F>
inline void with_row_vectors(int64_t vectors, F&& f) {
  static_assert(kRowVectors == 3);
  switch (vectors) {
    case 1: f(std::integral_constant<int64_t, 1>{}); break;
    case 2: f(std::integral_constant<int64_t, 2>{}); break;
    default: f(std::integral_constant<int64_t, 3>{}); break;
  }
}

// A thread's work space: an item's blocks of rows, and a segment of its keys and values as float32 rows
struct FlashRows {
  int64_t head_dim;
  std::vector<RowBlock> blocks;
  std::vector<float> keys, values;   // [kKeySegment][head_dim]
  std::vector<float> probs, staged;  // [kKeyTile][kRowBlock]: scores, then probabilities; [kRowBlock][head_dim]

  explicit FlashRows(int64_t head_dim)
      : head_dim(head_dim), keys(kKeySegment * head_dim), values(kKeySegment * head_dim),
        probs(kKeyTile * kRowBlock), staged(kRowBlock * head_dim) {}

  // keys [begin, end) of kv head h: the cached context from the cache, the chunk's own as computed
  template <typename T, typename C>
  void gather(const C* k_cache, const C* v_cache, const int64_t* table, int64_t h, int64_t begin, int64_t end,
              int64_t num_blocks, int64_t block_size, const ChunkKV<T>& chunk) {
    for (int64_t t = begin; t < end; ++t) {
      float* k = keys.data() + (t - begin) * head_dim;
      float* v = values.data() + (t - begin) * head_dim;
      if (t >= chunk.first) {
        to_float(chunk.key(t, h), k, head_dim);
        to_float(chunk.value(t, h), v, head_dim);
      } else {
        const int64_t offset = key_offset(table, h, t, num_blocks, block_size, head_dim);
        to_float(k_cache + offset, k, head_dim);
        to_float(v_cache + offset, v, head_dim);
      }
    }
  }

  // rows [r0, r0 + n) of an item into block b, row r at position first_pos + r / group, query head r % group of the
  // group at q[r / group * q_stride + r % group * head_dim]; the lanes past n (to a whole vector) repeat the last
  // row's position over zeros. `first_tile`: where a position's first key tile starts.
  template <typename T, typename F>
  void load_rows(int64_t b, const T* q, int64_t q_stride, int64_t group, int64_t r0, int64_t n, int64_t first_pos,
                 int64_t window, float scale, F&& first_tile) {
    if (static_cast<int64_t>(blocks.size()) <= b) blocks.resize(b + 1);
    RowBlock& block = blocks[b];
    block.q_t.resize(head_dim * kRowBlock);
    block.out_t.assign(head_dim * kRowBlock, 0.f);
    block.r0 = r0, block.n = n;
    block.begin = first_tile(first_pos + r0 / group), block.end = first_pos + (r0 + n - 1) / group + 1;
    const int64_t lanes = block.vectors() * LANES;
    std::fill(staged.data() + n * head_dim, staged.data() + lanes * head_dim, 0.f);
    for (int64_t i = 0; i < n; ++i) {
      const T* src = q + (r0 + i) / group * q_stride + (r0 + i) % group * head_dim;
      for (int64_t d = 0; d < head_dim; d += LANES) store(staged.data() + i * head_dim + d, load(src + d) * scale);
    }
    for (int64_t i = 0; i < lanes; i += 8)
      for (int64_t d = 0; d < head_dim; d += 8)
        transpose8(staged.data() + i * head_dim + d, head_dim, block.q_t.data() + d * kRowBlock + i, kRowBlock);
    for (int64_t i = 0; i < lanes; ++i) {
      const int64_t pos = first_pos + (r0 + std::min(i, n - 1)) / group;
      block.hi[i / LANES][i % LANES] = static_cast<int32_t>(pos);
      block.lo[i / LANES][i % LANES] = static_cast<int32_t>(window > 0 ? pos - window + 1 : 0);
    }
    for (int64_t v = 0; v < kRowVectors; ++v) block.max[v] = splat(kNegInf), block.denom[v] = floatv{};
  }

  // block b's output rows divided by their denominators, to out[r / group * row_stride + r % group * head_dim]
  template <typename T>
  void store_rows(int64_t b, T* out, int64_t row_stride, int64_t group) {
    RowBlock& block = blocks[b];
    const int64_t lanes = block.vectors() * LANES;
    for (int64_t v = 0; v < block.vectors(); ++v) {
      const floatv inv = splat(1.f) / block.denom[v];
      for (int64_t d = 0; d < head_dim; ++d) {
        float* o = block.out_t.data() + d * kRowBlock + v * LANES;
        store(o, load(o) * inv);
      }
    }
    for (int64_t i = 0; i < lanes; i += 8)
      for (int64_t d = 0; d < head_dim; d += 8)
        transpose8(block.out_t.data() + d * kRowBlock + i, kRowBlock, staged.data() + i * head_dim + d, head_dim);
    for (int64_t i = 0; i < block.n; ++i) {
      T* dst = out + (block.r0 + i) / group * row_stride + (block.r0 + i) % group * head_dim;
      for (int64_t d = 0; d < head_dim; d += LANES) store(dst + d, load(staged.data() + i * head_dim + d));
    }
  }

  // block b (ROWS vectors of rows) against its keys in the gathered segment [first, last): tiles of kKeyTile from
  // multiples of it
  template <int64_t ROWS>
  void attend(int64_t b, int64_t first, int64_t last) {
    RowBlock& block = blocks[b];
    for (int64_t t0 = std::max(first, block.begin); t0 < std::min(last, block.end); t0 += kKeyTile) {
      const int64_t n = std::min({kKeyTile, last - t0, block.end - t0});
      const float* k = keys.data() + (t0 - first) * head_dim;
      const float* v = values.data() + (t0 - first) * head_dim;
      in_blocks<kScoreKeys>(n, [&](auto keys_block, int64_t j) {
        score_keys<decltype(keys_block)::value, ROWS>(k + j * head_dim, block.q_t.data(),
                                                      probs.data() + j * kRowBlock, head_dim);
      });
      block.softmax<ROWS>(probs.data(), t0, n, head_dim);
      in_blocks<kValueDims>(head_dim, [&](auto dims, int64_t d) {
        weigh_dims<decltype(dims)::value, ROWS>(v + d, probs.data(), block.out_t.data() + d * kRowBlock, n,
                                                head_dim);
      });
    }
  }
};

// T: the queries' and output's dtype; C: the caches'. q rows `q_stride` apart (the heads of a position contiguous);
// k, v: the packed chunks' own K/V, `kv` with its strides and first = 0.
template <typename T, typename C>
void prefill_kernel(const T* q, int64_t q_stride, const ChunkKV<T>& kv, const C* k_cache, const C* v_cache,
                    const std::vector<Chunk>& chunks, T* out, int64_t num_heads, int64_t num_kv_heads,
                    int64_t num_blocks, int64_t block_size, int64_t head_dim, float scale, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  const std::vector<QueryBlock> blocks = query_blocks(chunks, window);
  const int64_t items = static_cast<int64_t>(blocks.size()) * num_kv_heads;
  // a row's first tile starts at a multiple of kKeyTile below its first visible key: tiles at fixed positions
  const auto first_tile = [&](int64_t pos) {
    return window > 0 ? std::max<int64_t>(0, pos - window + 1) / kKeyTile * kKeyTile : 0;
  };
  std::atomic<int64_t> next{0};
  inferno::parallel_for(0, std::min<int64_t>(inferno::num_threads(), items), 1, [&](int64_t, int64_t) {
    FlashRows rows(head_dim);
    for (int64_t item; (item = next.fetch_add(1)) < items;) {
      const QueryBlock& block = blocks[item / num_kv_heads];
      const Chunk& c = chunks[block.chunk];
      const int64_t h = item % num_kv_heads, first = block.first;
      const int64_t count = std::min(kQueryBlock, c.n - first), num_rows = count * group;
      const int64_t first_pos = c.num_computed + first, end = first_pos + count;  // keys [.., end) are needed
      // the chunk's own keys from its first position on, read where it starts in the packed k, v
      const ChunkKV<T> chunk{kv.k + c.start * kv.k_stride_t, kv.v + c.start * kv.v_stride_t, kv.k_stride_t,
                             kv.k_stride_h, kv.v_stride_t, kv.v_stride_h, c.num_computed};
      // the group's heads of a position are adjacent in q and out
      const T* q_item = q + (c.start + first) * q_stride + h * group * head_dim;
      T* out_item = out + ((c.start + first) * num_heads + h * group) * head_dim;
      const int64_t row_blocks = (num_rows + kRowBlock - 1) / kRowBlock;
      for (int64_t b = 0; b < row_blocks; ++b)
        rows.load_rows(b, q_item, q_stride, group, b * kRowBlock, std::min(kRowBlock, num_rows - b * kRowBlock),
                       first_pos, window, scale, first_tile);
      for (int64_t segment = first_tile(first_pos); segment < end; segment += kKeySegment) {
        const int64_t last = std::min(segment + kKeySegment, end);
        rows.gather(k_cache, v_cache, c.table, h, segment, last, num_blocks, block_size, chunk);
        for (int64_t b = 0; b < row_blocks; ++b)
          with_row_vectors(rows.blocks[b].vectors(),
                           [&](auto vectors) { rows.attend<decltype(vectors)::value>(b, segment, last); });
      }
      for (int64_t b = 0; b < row_blocks; ++b) rows.store_rows(b, out_item, num_heads * head_dim, group);
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
    const ChunkKV<T> kv{k.data_ptr<T>(), v.data_ptr<T>(), k.stride(0), k.stride(1), v.stride(0), v.stride(1), 0};
    const auto run = [&](auto kernel) {
      kernel(q.data_ptr<T>(), q.stride(0), kv, k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), chunks,
             out.data_ptr<T>(), q.size(1), k_cache.size(0), k_cache.size(1), k_cache.size(2), q.size(2),
             static_cast<float>(scale), window);
    };
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<C, c10::BFloat16>) {
      run(bf16::prefill_kernel);
      return;
    }
#endif
    run(&prefill_kernel<T, C>);
  });
}

}  // namespace inferno::cpu
