// Decode attention over a paged KV cache on the CPU: one query token per sequence, K/V read once through the
// block table (no gather copy), softmax in float32. Parallel over (sequence, kv head).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                          const int64_t* seq_lens, T* out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                          int64_t num_blocks, int64_t block_size, int64_t head_dim, int64_t table_width,
                          float scale) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads, len = seq_lens[b];
      const T* q_row = q + (b * num_heads + h * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) query[i] = static_cast<float>(q_row[i]) * scale;
      scores.resize(group * len);
      // scores[g, t] = q_g . k_t
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = block_tables[b * table_width + t / block_size];
        const T* k_row = k_cache + ((h * num_blocks + block) * block_size + t % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = query.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(k_row[d]);
          scores[g * len + t] = dot;
        }
      }
      // softmax over t, per query head
      std::vector<float> denom(group);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) max = std::max(max, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - max);
          sum += s[t];
        }
        denom[g] = sum;
      }
      // out_g = sum_t p[g, t] v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = block_tables[b * table_width + t / block_size];
        const T* v_row = v_cache + ((h * num_blocks + block) * block_size + t % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<float>(v_row[d]);
        }
      }
      T* out_row = out + (b * num_heads + h * group) * head_dim;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          out_row[g * head_dim + d] = static_cast<T>(acc[g * head_dim + d] / denom[g]);
    }
  });
}

// q [B, H, D]; caches [KVH, num_blocks, block_size, D]; block_tables [B, W] int64; seq_lens [B] int64
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == torch::kLong, "block_tables: int64");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.scalar_type() == torch::kLong, "seq_lens: int64");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                            q.size(0), q.size(1), k_cache.size(0), k_cache.size(1), k_cache.size(2), q.size(2),
                            block_tables.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention through block tables (CPU)");
}
