// Decode attention over a paged KV cache on the CPU: one query token per sequence, K/V read once through the
// block table (no gather copy), softmax in float32. Registered as the operator `inferno::paged_decode_attention`
// so that eager calls go through the dispatcher and `torch.compile` can place it in a graph.
//
// Work items are (sequence, kv head, split): a long sequence is cut into splits of whole blocks so that one
// request still keeps every thread busy (flash-decoding). Each split keeps its own running max, softmax
// denominator and unnormalised output; the splits are merged at the end, rescaled to the common max.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kMinSplitTokens = 128;  // below this, a split's fixed cost outweighs the parallelism it adds

struct Partial {  // one split of one (sequence, kv head): per query head of the group
  std::vector<float> max, denom, acc;  // [group], [group], [group * head_dim]
};

template <typename T>
void attend_split(const float* query, const T* k_cache, const T* v_cache, const int64_t* table, int64_t h,
                  int64_t begin, int64_t end, int64_t group, int64_t num_blocks, int64_t block_size,
                  int64_t head_dim, std::vector<float>& scores, Partial& out) {
  const int64_t len = end - begin;
  scores.resize(group * len);
  for (int64_t t = begin; t < end; ++t) {  // scores[g, t] = q_g . k_t
    const int64_t row = (h * num_blocks + table[t / block_size]) * block_size + t % block_size;
    const T* k_row = k_cache + row * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = query + g * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(k_row[d]);
      scores[g * len + t - begin] = dot;
    }
  }
  out.max.assign(group, -std::numeric_limits<float>::infinity());
  out.denom.assign(group, 0.f);
  out.acc.assign(group * head_dim, 0.f);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * len;
    float max = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < len; ++i) max = std::max(max, s[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < len; ++i) {
      s[i] = std::exp(s[i] - max);
      sum += s[i];
    }
    out.max[g] = max;
    out.denom[g] = sum;
  }
  for (int64_t t = begin; t < end; ++t) {  // acc_g = sum_t p[g, t] v_t
    const int64_t row = (h * num_blocks + table[t / block_size]) * block_size + t % block_size;
    const T* v_row = v_cache + row * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + t - begin];
      float* a = out.acc.data() + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<float>(v_row[d]);
    }
  }
}

template <typename T>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                   const int64_t* seq_lens, T* out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                   int64_t num_blocks, int64_t block_size, int64_t head_dim, int64_t table_width, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) max_len = std::max(max_len, seq_lens[b]);
  // enough items for every thread, each split a whole number of blocks and at least kMinSplitTokens long
  const int64_t wanted = (2 * at::get_num_threads() + batch * num_kv_heads - 1) / (batch * num_kv_heads);
  const int64_t min_blocks = (kMinSplitTokens + block_size - 1) / block_size;
  const int64_t max_splits = std::max<int64_t>(1, (max_len + block_size - 1) / block_size / min_blocks);
  const int64_t splits = std::clamp<int64_t>(wanted, 1, max_splits);
  const int64_t split_blocks = ((max_len + block_size - 1) / block_size + splits - 1) / splits;
  std::vector<Partial> partials(batch * num_kv_heads * splits);

  at::parallel_for(0, batch * num_kv_heads * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (num_kv_heads * splits), h = item / splits % num_kv_heads, s = item % splits;
      const int64_t first = std::min(s * split_blocks * block_size, seq_lens[b]);
      const int64_t last = std::min(first + split_blocks * block_size, seq_lens[b]);
      Partial& part = partials[item];
      if (first == last) {  // a short sequence in a batch split for a longer one
        part.max.assign(group, -std::numeric_limits<float>::infinity());
        continue;
      }
      const T* q_row = q + (b * num_heads + h * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) query[i] = static_cast<float>(q_row[i]) * scale;
      attend_split(query.data(), k_cache, v_cache, block_tables + b * table_width, h, first, last, group,
                   num_blocks, block_size, head_dim, scores, part);
    }
  });

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const Partial* parts = partials.data() + item * splits;
      for (int64_t g = 0; g < group; ++g) {
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < splits; ++s) max = std::max(max, parts[s].max[g]);
        float denom = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t s = 0; s < splits; ++s) {
          if (parts[s].max[g] == -std::numeric_limits<float>::infinity()) continue;
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

// q [B, H, D]; caches [KVH, num_blocks, block_size, D]; block_tables [B, W] int64; seq_lens [B] int64
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong, "block_tables: int64");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.scalar_type() == at::kLong, "seq_lens: int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must have one dtype");
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                            q.size(0), q.size(1), k_cache.size(0), k_cache.size(1), k_cache.size(2), q.size(2),
                            block_tables.size(1), static_cast<float>(scale));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferno, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(inferno, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
