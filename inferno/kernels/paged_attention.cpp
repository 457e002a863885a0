// Decode attention over a paged KV cache on the CPU: one query token per sequence, K/V read once through the
// block table (no gather copy), softmax in float32. Registered as the operator `inferno::paged_decode_attention`
// (ops.cpp) so that eager calls go through the dispatcher and `torch.compile` can place it in a graph.
//
// Work items are (sequence, kv head, split): a long sequence is cut into splits of whole blocks so that one
// request still keeps every thread busy (flash-decoding). Each split keeps its own max, softmax denominator and
// unnormalised output; the splits are merged at the end, rescaled to the common max. How a sequence is split
// depends on its length alone (and the thread count it is planned for, the engine's, not the threads it runs on), so
// its output does not depend on the batch it is in.
//
// Within a split everything is one register wide (GCC vector extensions of the machine's width: 16 floats with
// AVX-512, 8 with AVX2 — a vector wider than the registers compiles into stack traffic): each K/V row comes from
// memory once for all query heads of its group (from L1 for the others), the scores of LANES keys are finished
// together by a transposing reduction tree instead of one horizontal sum per key, and exp is a vector polynomial.
#include "entry_points.h"
#include "float_vectors.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kAccumulators = LANES == 16 ? 16 : 8;  // vector sums weigh_values keeps in registers
constexpr int64_t kMinSplitTokens = 128;  // below this, a split's fixed cost outweighs the parallelism it adds

// s[j] = sum of the lanes of v[j], for LANES vectors: pairs are folded in halves, quarters, ..., so that every add
// serves all the sums at once (LANES - 1 adds instead of LANES horizontal sums).
#if defined(__AVX512F__)
inline floatv sum_lanes_of_all(const floatv* v) {
  floatv halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i)  // [v_2i halves summed, v_2i+1 halves summed]
    halves[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], intv{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
                __builtin_shuffle(v[2 * i], v[2 * i + 1], intv{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  for (int i = 0; i < 4; ++i)  // four sums of 4 partials each, in order
    quarters[i] = __builtin_shuffle(halves[2 * i], halves[2 * i + 1], intv{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
                  __builtin_shuffle(halves[2 * i], halves[2 * i + 1], intv{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
  for (int i = 0; i < 2; ++i)  // eight sums of 2 partials each
    eighths[i] = __builtin_shuffle(quarters[2 * i], quarters[2 * i + 1], intv{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
                 __builtin_shuffle(quarters[2 * i], quarters[2 * i + 1], intv{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
  return __builtin_shuffle(eighths[0], eighths[1], intv{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
         __builtin_shuffle(eighths[0], eighths[1], intv{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}
#else
inline floatv sum_lanes_of_all(const floatv* v) {
  floatv halves[4], quarters[2];
  for (int i = 0; i < 4; ++i)  // [v_2i halves summed, v_2i+1 halves summed]
    halves[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], intv{0, 1, 2, 3, 8, 9, 10, 11}) +
                __builtin_shuffle(v[2 * i], v[2 * i + 1], intv{4, 5, 6, 7, 12, 13, 14, 15});
  for (int i = 0; i < 2; ++i)  // four sums of 2 partials each, in order
    quarters[i] = __builtin_shuffle(halves[2 * i], halves[2 * i + 1], intv{0, 1, 4, 5, 8, 9, 12, 13}) +
                  __builtin_shuffle(halves[2 * i], halves[2 * i + 1], intv{2, 3, 6, 7, 10, 11, 14, 15});
  return __builtin_shuffle(quarters[0], quarters[1], intv{0, 2, 4, 6, 8, 10, 12, 14}) +
         __builtin_shuffle(quarters[0], quarters[1], intv{1, 3, 5, 7, 9, 11, 13, 15});
}
#endif

struct Partial {  // one split of one (sequence, kv head): per query head of the group
  std::vector<float> max, denom, acc;  // [group], [group], [group * head_dim]
};

struct Scratch {  // per thread, reused across work items
  std::vector<floatv> dots;    // [group * LANES]: one vector of partial sums per (query head, key) of a tile
  std::vector<float> scores;   // [group * padded split length]
  std::vector<int64_t> rows;   // the cache offset of every key of the split (the same in K and V)
};

// acc[h, c0:c0+CHUNKS] = sum_t scores[h, t] v_t[c0:c0+CHUNKS] for HEADS query heads, in registers
template <typename T, int64_t CHUNKS, int64_t HEADS>
void weigh_values(const T* v_cache, const int64_t* rows, int64_t len, const float* scores, int64_t padded,
                  float* acc, int64_t head_dim, int64_t c0) {
  floatv sum[HEADS][CHUNKS] = {};
  for (int64_t t = 0; t < len; ++t) {
    const T* v_row = v_cache + rows[t] + c0 * LANES;
    floatv p[HEADS];
    for (int64_t h = 0; h < HEADS; ++h) p[h] = splat(scores[h * padded + t]);
    for (int64_t c = 0; c < CHUNKS; ++c) {
      const floatv v = load(v_row + c * LANES);
      for (int64_t h = 0; h < HEADS; ++h) sum[h][c] += p[h] * v;
    }
  }
  for (int64_t h = 0; h < HEADS; ++h)
    for (int64_t c = 0; c < CHUNKS; ++c) store(acc + h * head_dim + (c0 + c) * LANES, sum[h][c]);
}

// acc_g = sum_t p[g, t] v_t for every query head of the group: tiles of 2 heads x kAccumulators / 2 vectors of
// the row (1 head for an odd last one), then single vectors for a row that is not a whole number of tiles
template <typename T>
void weigh_all_values(const T* v_cache, const int64_t* rows, int64_t len, const float* scores, int64_t padded,
                      float* acc, int64_t group, int64_t head_dim) {
  constexpr int64_t tile = kAccumulators / 2;
  const int64_t chunks = head_dim / LANES, whole = chunks / tile * tile;
  for (int64_t g = 0; g < group; g += 2) {
    const bool pair = g + 1 < group;
    const float* s = scores + g * padded;
    float* a = acc + g * head_dim;
    for (int64_t c = 0; c < whole; c += tile)
      (pair ? weigh_values<T, tile, 2> : weigh_values<T, tile, 1>)(v_cache, rows, len, s, padded, a, head_dim, c);
    for (int64_t c = whole; c < chunks; ++c)
      (pair ? weigh_values<T, 1, 2> : weigh_values<T, 1, 1>)(v_cache, rows, len, s, padded, a, head_dim, c);
  }
}

template <typename T>
void attend_split(const float* query, const T* k_cache, const T* v_cache, const int64_t* table, int64_t h,
                  int64_t begin, int64_t end, int64_t group, int64_t num_blocks, int64_t block_size,
                  int64_t head_dim, Scratch& scratch, Partial& out) {
  const int64_t len = end - begin, padded = (len + LANES - 1) / LANES * LANES;
  const int64_t chunks = head_dim / LANES;
  scratch.rows.resize(len);
  for (int64_t t = begin; t < end;) {  // one division per block, not per key
    const int64_t block = t / block_size, stop = std::min(end, (block + 1) * block_size);
    const int64_t base = (h * num_blocks + table[block]) * block_size - block * block_size;
    for (; t < stop; ++t) scratch.rows[t - begin] = (base + t) * head_dim;
  }
  scratch.dots.resize(group * LANES);
  scratch.scores.resize(group * padded);
  float* scores = scratch.scores.data();

  // scores[g, t] = q_g . k_t, LANES keys at a time; the key row stays in L1 while every head of the group reads it
  for (int64_t tile = 0; tile < padded; tile += LANES) {
    const int64_t keys = std::min(LANES, len - tile);
    for (int64_t j = 0; j < LANES; ++j) {
      if (j >= keys) {
        for (int64_t g = 0; g < group; ++g) scratch.dots[g * LANES + j] = floatv{};
        continue;
      }
      const T* k_row = k_cache + scratch.rows[tile + j];
      prefetch_row(v_cache + scratch.rows[tile + j], head_dim);  // for the weighted sum below
      if (tile + LANES + j < len) prefetch_row(k_cache + scratch.rows[tile + LANES + j], head_dim);
      for (int64_t g = 0; g < group; ++g) {
        const float* q = query + g * head_dim;
        floatv dot0{}, dot1{};  // two chains, so that one FMA does not wait on the last
        int64_t c = 0;
        for (; c + 1 < chunks; c += 2) {
          dot0 += load(q + c * LANES) * load(k_row + c * LANES);
          dot1 += load(q + (c + 1) * LANES) * load(k_row + (c + 1) * LANES);
        }
        if (c < chunks) dot0 += load(q + c * LANES) * load(k_row + c * LANES);
        scratch.dots[g * LANES + j] = dot0 + dot1;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      floatv s = sum_lanes_of_all(scratch.dots.data() + g * LANES);
      for (int64_t j = keys; j < LANES; ++j) s[j] = kNegInf;
      store(scores + g * padded + tile, s);
    }
  }

  // softmax numerators, in place, and their sums
  out.max.assign(group, kNegInf);
  out.denom.assign(group, 0.f);
  out.acc.assign(group * head_dim, 0.f);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * padded;
    floatv m = splat(kNegInf);
    for (int64_t i = 0; i < padded; i += LANES) {
      const floatv v = load(s + i);
      m = v > m ? v : m;
    }
    const float max = max_lanes(m);
    floatv sum{};
    for (int64_t i = 0; i < padded; i += LANES) {
      const floatv p = exp_lanes(load(s + i) - max);
      store(s + i, p);
      sum += p;
    }
    out.max[g] = max;
    out.denom[g] = sum_lanes(sum);
  }
  weigh_all_values(v_cache, scratch.rows.data(), len, scores, padded, out.acc.data(), group, head_dim);
}

struct Item {  // one work item: keys [first, last) of sequence b for kv head h, split s of its `splits`
  int64_t b, h, s, splits, first, last;
};

// Every sequence's work items. A sequence's splits depend on its own length and `threads` only, never on the rest of
// the batch or on the threads the call runs on, so its output is the same bits alone or batched, on all threads or
// fewer: as many as would keep `threads` threads busy were it alone, each a whole number of blocks and at least
// kMinSplitTokens long.
inline std::vector<Item> work_items(const int64_t* seq_lens, int64_t batch, int64_t num_kv_heads, int64_t block_size,
                                    int64_t window, int64_t threads) {
  const int64_t wanted = (2 * threads + num_kv_heads - 1) / num_kv_heads;
  const int64_t min_blocks = (kMinSplitTokens + block_size - 1) / block_size;
  std::vector<Item> items;
  items.reserve(batch * num_kv_heads);
  for (int64_t b = 0; b < batch; ++b) {
    // keys [begin, seq_len): all of them, or the last `window` (sliding-window layers)
    const int64_t begin = window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0;
    const int64_t blocks = (seq_lens[b] - begin + block_size - 1) / block_size;
    const int64_t splits = std::clamp<int64_t>(wanted, 1, std::max<int64_t>(1, blocks / min_blocks));
    const int64_t split_tokens = (blocks + splits - 1) / splits * block_size;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t first = std::min(begin + s * split_tokens, seq_lens[b]);
        items.push_back({b, h, s, splits, first, std::min(first + split_tokens, seq_lens[b])});
      }
  }
  return items;
}

// T: the query's and the output's dtype; C: the caches' (float16 caches under a float32 model, as llama.cpp keeps
// them, read through F16C)
template <typename T, typename C>
void decode_kernel(const T* q, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                   const int64_t* seq_lens, T* out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                   int64_t num_blocks, int64_t block_size, int64_t head_dim, int64_t table_width, float scale,
                   int64_t window, int64_t threads) {
  const int64_t group = num_heads / num_kv_heads;
  const std::vector<Item> items = work_items(seq_lens, batch, num_kv_heads, block_size, window, threads);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const auto write = [&](const Item& item, const float* acc, const float* denom) {
    for (int64_t g = 0; g < group; ++g) {
      T* out_row = out + (item.b * num_heads + item.h * group + g) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) out_row[d] = static_cast<T>(acc[g * head_dim + d] / denom[g]);
    }
  };

  // A sequence of one split is final at once: normalised and written out. The others' splits are merged below.
  const bool any_split = std::any_of(items.begin(), items.end(), [](const Item& item) { return item.splits > 1; });
  std::vector<Partial> partials(any_split ? num_items : 0);
  inferno::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim);
    Scratch scratch;
    Partial whole;
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = items[i];
      Partial& part = item.splits > 1 ? partials[i] : whole;
      if (item.first == item.last) {  // a split past the end of a sequence shorter than its splits
        part.max.assign(group, kNegInf);
        continue;
      }
      const T* q_row = q + (item.b * num_heads + item.h * group) * head_dim;
      for (int64_t x = 0; x < group * head_dim; ++x) query[x] = static_cast<float>(q_row[x]) * scale;
      attend_split<C>(query.data(), k_cache, v_cache, block_tables + item.b * table_width, item.h, item.first,
                      item.last, group, num_blocks, block_size, head_dim, scratch, part);
      if (item.splits == 1) write(item, part.acc.data(), part.denom.data());
    }
  });
  if (!any_split) return;

  // the first split of each (sequence, kv head) merges its sequence's splits, in order
  inferno::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * head_dim), denom(group);
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = items[i];
      if (item.splits == 1 || item.s != 0) continue;
      const Partial* parts = partials.data() + i;
      for (int64_t g = 0; g < group; ++g) {
        float max = kNegInf;
        for (int64_t s = 0; s < item.splits; ++s) max = std::max(max, parts[s].max[g]);
        float sum = 0.f;
        float* a_g = acc.data() + g * head_dim;
        std::fill(a_g, a_g + head_dim, 0.f);
        for (int64_t s = 0; s < item.splits; ++s) {
          if (parts[s].max[g] == kNegInf) continue;
          const float w = std::exp(parts[s].max[g] - max);
          sum += w * parts[s].denom[g];
          const float* a = parts[s].acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a_g[d] += w * a[d];
        }
        denom[g] = sum;
      }
      write(item, acc.data(), denom.data());
    }
  });
}

}  // namespace

namespace inferno::cpu {

void paged_decode_attention(const View& q, const View& k_cache, const View& v_cache, const View& block_tables,
                            const View& seq_lens, double scale, int64_t window, int64_t threads, const View& out) {
  const auto run = [&](auto* type, auto* cache_type) {
    using T = std::remove_pointer_t<decltype(type)>;
    using C = std::remove_pointer_t<decltype(cache_type)>;
    decode_kernel<T, C>(q.data_ptr<T>(), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), block_tables.data_ptr<int64_t>(),
                     seq_lens.data_ptr<int64_t>(), out.data_ptr<T>(), q.size(0), q.size(1), k_cache.size(0),
                     k_cache.size(1), k_cache.size(2), q.size(2), block_tables.size(1), static_cast<float>(scale),
                     window, threads);
  };
  dispatch_query_and_cache(q.scalar_type(), k_cache.scalar_type(), run);
}

}  // namespace inferno::cpu
