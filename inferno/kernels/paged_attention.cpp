// Decode attention over a paged KV cache on the CPU: one query token per sequence, K/V read once through the
// block table (no gather copy), softmax in float32. Registered as the operator `inferno::paged_decode_attention`
// so that eager calls go through the dispatcher and `torch.compile` can place it in a graph.
//
// Work items are (sequence, kv head, split): a long sequence is cut into splits of whole blocks so that one
// request still keeps every thread busy (flash-decoding). Each split keeps its own max, softmax denominator and
// unnormalised output; the splits are merged at the end, rescaled to the common max.
//
// Within a split everything is 16 lanes wide (one AVX-512 register; GCC vector extensions, so other targets get
// the same code in narrower registers): each K/V row is converted to float once for all query heads of its group,
// the scores of 16 keys are finished together by a transposing reduction tree instead of one horizontal sum per
// key, and exp is a vector polynomial.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t kMaxHeadChunks = 16;    // head_dim up to 256
constexpr int64_t kMinSplitTokens = 128;  // below this, a split's fixed cost outweighs the parallelism it adds
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

typedef float floatx16 __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t intx16 __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t uintx16 __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t ushortx16 __attribute__((vector_size(LANES * sizeof(uint16_t))));

inline floatx16 load16(const float* p) {
  floatx16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline floatx16 load16(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  ushortx16 h;
  std::memcpy(&h, p, sizeof(h));
  return (floatx16)(__builtin_convertvector(h, uintx16) << 16);
}

inline floatx16 load16(const c10::Half* p) {
#if defined(__AVX512F__)
  return (floatx16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const __m256 halves[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  floatx16 v;
  std::memcpy(&v, halves, sizeof(v));
  return v;
#else
  floatx16 v;
  for (int64_t i = 0; i < LANES; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline void store16(float* p, floatx16 v) { std::memcpy(p, &v, sizeof(v)); }

// Cache rows are scattered over the pool block by block: fetch the next keys (and each key's value) ahead.
template <typename T>
inline void prefetch_row(const T* row, int64_t head_dim) {
  for (int64_t i = 0; i < head_dim * static_cast<int64_t>(sizeof(T)); i += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + i);
}

inline floatx16 splat(float x) { return floatx16{} + x; }

inline float max_lanes(floatx16 v) {
  float m = v[0];
  for (int64_t i = 1; i < LANES; ++i) m = std::max(m, v[i]);
  return m;
}

inline float sum_lanes(floatx16 v) {
  float s = 0.f;
  for (int64_t i = 0; i < LANES; ++i) s += v[i];
  return s;
}

// exp(x) for x <= 0 (scores minus their max), relative error ~1e-7; 0 below -87 (and for -inf, masked keys).
inline floatx16 exp16(floatx16 x) {
  const intx16 live = x > -87.f;
  x = x < -87.f ? splat(-87.f) : x;
  const floatx16 shifted = x * 1.44269504f + 12582912.f;  // 1.5 * 2^23: rounds x / ln 2 to an integer n
  const floatx16 n = shifted - 12582912.f;
  const floatx16 r = x - n * 0.693145752f - n * 1.42860677e-6f;  // ln 2 split in two for an exact reduction
  floatx16 p = splat(1.f / 720) * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const intx16 two_n = ((intx16)shifted - 0x4B400000 + 127) << 23;  // 2^n built in the exponent bits
  return (floatx16)((intx16)(p * (floatx16)two_n) & live);
}

// s[j] = sum of the lanes of v[j], for 16 vectors: pairs are folded in halves, quarters, eighths, lanes, so that
// every add serves all 16 sums at once (15 adds and 30 shuffles instead of 16 horizontal sums).
inline floatx16 sum_lanes_of_16(const floatx16* v) {
  floatx16 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i)  // [v_2i halves summed, v_2i+1 halves summed]
    halves[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], intx16{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
                __builtin_shuffle(v[2 * i], v[2 * i + 1], intx16{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  for (int i = 0; i < 4; ++i)  // four sums of 4 partials each, in order
    quarters[i] = __builtin_shuffle(halves[2 * i], halves[2 * i + 1], intx16{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
                  __builtin_shuffle(halves[2 * i], halves[2 * i + 1], intx16{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
  for (int i = 0; i < 2; ++i)  // eight sums of 2 partials each
    eighths[i] = __builtin_shuffle(quarters[2 * i], quarters[2 * i + 1], intx16{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
                 __builtin_shuffle(quarters[2 * i], quarters[2 * i + 1], intx16{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
  return __builtin_shuffle(eighths[0], eighths[1], intx16{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
         __builtin_shuffle(eighths[0], eighths[1], intx16{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

struct Partial {  // one split of one (sequence, kv head): per query head of the group
  std::vector<float> max, denom, acc;  // [group], [group], [group * head_dim]
};

struct Scratch {  // per thread, reused across work items
  std::vector<floatx16> dots;  // [group * 16]: one vector of partial sums per (query head, key) of a tile
  std::vector<float> scores;   // [group * padded split length]
  std::vector<int64_t> rows;   // the cache offset of every key of the split (the same in K and V)
};

// acc[h] = sum_t scores[h, t] v_t for HEADS query heads, the sums held in registers (HEADS * CHUNKS <= 16)
template <typename T, int64_t CHUNKS, int64_t HEADS>
void weigh_values(const T* v_cache, const int64_t* rows, int64_t len, const float* scores, int64_t padded,
                  float* acc) {
  floatx16 sum[HEADS][CHUNKS] = {};
  for (int64_t t = 0; t < len; ++t) {
    const T* v_row = v_cache + rows[t];
    floatx16 v[CHUNKS];
    for (int64_t c = 0; c < CHUNKS; ++c) v[c] = load16(v_row + c * LANES);
    for (int64_t h = 0; h < HEADS; ++h) {
      const float p = scores[h * padded + t];
      for (int64_t c = 0; c < CHUNKS; ++c) sum[h][c] += p * v[c];
    }
  }
  for (int64_t h = 0; h < HEADS; ++h)
    for (int64_t c = 0; c < CHUNKS; ++c) store16(acc + (h * CHUNKS + c) * LANES, sum[h][c]);
}

// CHUNKS: head_dim / 16 when known at compile time (the common 64 and 128), else 0
template <typename T, int64_t CHUNKS>
void attend_split(const float* query, const T* k_cache, const T* v_cache, const int64_t* table, int64_t h,
                  int64_t begin, int64_t end, int64_t group, int64_t num_blocks, int64_t block_size,
                  int64_t head_dim, Scratch& scratch, Partial& out) {
  const int64_t len = end - begin, padded = (len + LANES - 1) / LANES * LANES;
  const int64_t chunks = CHUNKS > 0 ? CHUNKS : head_dim / LANES;
  scratch.rows.resize(len);
  for (int64_t t = begin; t < end;) {  // one division per block, not per key
    const int64_t block = t / block_size, stop = std::min(end, (block + 1) * block_size);
    const int64_t base = (h * num_blocks + table[block]) * block_size - block * block_size;
    for (; t < stop; ++t) scratch.rows[t - begin] = (base + t) * head_dim;
  }
  scratch.dots.resize(group * LANES);
  scratch.scores.resize(group * padded);
  float* scores = scratch.scores.data();

  // scores[g, t] = q_g . k_t, 16 keys at a time
  for (int64_t tile = 0; tile < padded; tile += LANES) {
    const int64_t keys = std::min(LANES, len - tile);
    for (int64_t j = 0; j < LANES; ++j) {
      if (j >= keys) {
        for (int64_t g = 0; g < group; ++g) scratch.dots[g * LANES + j] = floatx16{};
        continue;
      }
      const T* k_row = k_cache + scratch.rows[tile + j];
      prefetch_row(v_cache + scratch.rows[tile + j], head_dim);  // for the weighted sum below
      if (tile + LANES + j < len) prefetch_row(k_cache + scratch.rows[tile + LANES + j], head_dim);
      floatx16 k[kMaxHeadChunks];
      for (int64_t c = 0; c < chunks; ++c) k[c] = load16(k_row + c * LANES);
      for (int64_t g = 0; g < group; ++g) {
        floatx16 dot{};
        for (int64_t c = 0; c < chunks; ++c)
          dot += load16(query + (g * chunks + c) * LANES) * k[c];
        scratch.dots[g * LANES + j] = dot;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      floatx16 s = sum_lanes_of_16(scratch.dots.data() + g * LANES);
      for (int64_t j = keys; j < LANES; ++j) s[j] = kNegInf;
      store16(scores + g * padded + tile, s);
    }
  }

  // softmax numerators, in place, and their sums
  out.max.assign(group, kNegInf);
  out.denom.assign(group, 0.f);
  out.acc.assign(group * head_dim, 0.f);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * padded;
    floatx16 m = splat(kNegInf);
    for (int64_t i = 0; i < padded; i += LANES) {
      const floatx16 v = load16(s + i);
      m = v > m ? v : m;
    }
    const float max = max_lanes(m);
    floatx16 sum{};
    for (int64_t i = 0; i < padded; i += LANES) {
      const floatx16 p = exp16(load16(s + i) - max);
      store16(s + i, p);
      sum += p;
    }
    out.max[g] = max;
    out.denom[g] = sum_lanes(sum);
  }

  // acc_g = sum_t p[g, t] v_t
  float* acc = out.acc.data();
  if constexpr (CHUNKS > 0) {  // query heads in tiles whose sums fit in registers; each V row converted per tile
    constexpr int64_t tile = 16 / CHUNKS;
    for (int64_t g0 = 0; g0 < group; g0 += tile) {
      const int64_t heads = std::min(tile, group - g0);
      const auto weigh = heads == tile ? weigh_values<T, CHUNKS, tile> : heads == 3 ? weigh_values<T, CHUNKS, 3>
                       : heads == 2 ? weigh_values<T, CHUNKS, 2> : weigh_values<T, CHUNKS, 1>;
      weigh(v_cache, scratch.rows.data(), len, scores + g0 * padded, padded, acc + g0 * head_dim);
    }
    return;
  }
  for (int64_t t = 0; t < len; ++t) {
    const T* v_row = v_cache + scratch.rows[t];
    floatx16 v[kMaxHeadChunks];
    for (int64_t c = 0; c < chunks; ++c) v[c] = load16(v_row + c * LANES);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * padded + t];
      float* a = acc + g * head_dim;
      for (int64_t c = 0; c < chunks; ++c) store16(a + c * LANES, load16(a + c * LANES) + p * v[c]);
    }
  }
}

template <typename T>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                   const int64_t* seq_lens, T* out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                   int64_t num_blocks, int64_t block_size, int64_t head_dim, int64_t table_width, float scale,
                   int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  // a sequence attends keys [begin_of(b), seq_len): all of them, or the last `window` (sliding-window layers)
  const auto begin_of = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0; };
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) max_len = std::max(max_len, seq_lens[b] - begin_of(b));
  // enough items for every thread, each split a whole number of blocks and at least kMinSplitTokens long
  const int64_t wanted = (2 * at::get_num_threads() + batch * num_kv_heads - 1) / (batch * num_kv_heads);
  const int64_t min_blocks = (kMinSplitTokens + block_size - 1) / block_size;
  const int64_t max_splits = std::max<int64_t>(1, (max_len + block_size - 1) / block_size / min_blocks);
  const int64_t splits = std::clamp<int64_t>(wanted, 1, max_splits);
  const int64_t split_blocks = ((max_len + block_size - 1) / block_size + splits - 1) / splits;

  // With one split per sequence the partial result is final: normalised and written out at once.
  std::vector<Partial> partials(splits > 1 ? batch * num_kv_heads * splits : 0);
  at::parallel_for(0, batch * num_kv_heads * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim);
    Scratch scratch;
    Partial whole;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (num_kv_heads * splits), h = item / splits % num_kv_heads, s = item % splits;
      const int64_t first = std::min(begin_of(b) + s * split_blocks * block_size, seq_lens[b]);
      const int64_t last = std::min(first + split_blocks * block_size, seq_lens[b]);
      Partial& part = splits > 1 ? partials[item] : whole;
      if (first == last) {  // a short sequence in a batch split for a longer one
        part.max.assign(group, kNegInf);
        continue;
      }
      const T* q_row = q + (b * num_heads + h * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) query[i] = static_cast<float>(q_row[i]) * scale;
      const auto attend = head_dim == 64 ? attend_split<T, 4> : head_dim == 128 ? attend_split<T, 8>
                        : attend_split<T, 0>;
      attend(query.data(), k_cache, v_cache, block_tables + b * table_width, h, first, last, group, num_blocks,
             block_size, head_dim, scratch, part);
      if (splits == 1)
        for (int64_t g = 0; g < group; ++g) {
          T* out_row = out + (b * num_heads + h * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) out_row[d] = static_cast<T>(part.acc[g * head_dim + d] / part.denom[g]);
        }
    }
  });
  if (splits == 1) return;

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const Partial* parts = partials.data() + item * splits;
      for (int64_t g = 0; g < group; ++g) {
        float max = kNegInf;
        for (int64_t s = 0; s < splits; ++s) max = std::max(max, parts[s].max[g]);
        float denom = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t s = 0; s < splits; ++s) {
          if (parts[s].max[g] == kNegInf) continue;
          const float w = std::exp(parts[s].max[g] - max);
          denom += w * parts[s].denom[g];
          const float* a = parts[s].acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) acc[d] += w * a[d];
        }
        T* out_row = out + (b * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) out_row[d] = static_cast<T>(acc[d] / denom);
      }
    }
  });
}

// q [B, H, D]; caches [KVH, num_blocks, block_size, D]; block_tables [B, W] int64; seq_lens [B] int64;
// D a multiple of 16, at most 256; window > 0: only the last `window` keys of each sequence
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong, "block_tables: int64");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.scalar_type() == at::kLong, "seq_lens: int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must have one dtype");
  TORCH_CHECK(q.size(2) % LANES == 0 && q.size(2) <= LANES * kMaxHeadChunks,
              "head_dim must be a multiple of 16 up to 256, got ", q.size(2));
  auto out = at::empty_like(q);
  const auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    decode_kernel<T>(q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), block_tables.data_ptr<int64_t>(),
                     seq_lens.data_ptr<int64_t>(), out.data_ptr<T>(), q.size(0), q.size(1), k_cache.size(0),
                     k_cache.size(1), k_cache.size(2), q.size(2), block_tables.size(1), static_cast<float>(scale),
                     window);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "paged_decode_attention: float32, bfloat16 or float16, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferno, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(inferno, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
