// The LoRA product of a step's token rows (`inferno::lora_bgmv`, layers/lora.py), punica's BGMV idea on the CPU:
// row t gets (x[t] A[s]^T) B[s] for its slot s, slot 0 ("no adapter") a zero row. The rows are grouped per slot, so
// a step reads the A and B of the slots it uses, each once however many rows use it, and no other slot's. B is read
// only in each slice's own columns (the fused q/k/v and gate/up stacks hold zeros elsewhere). float32, bfloat16 or
// float16 matrices; arithmetic in float32, the output rounded once.
#include "entry_points.h"
#include "float_vectors.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t MAX_BLOCK_ROWS = 4;  // x rows sharing each load of an A row
constexpr int64_t CHUNK = 4 * LANES;   // output columns per work item of the expand: 4 accumulators a row

struct SlotRows {  // a slot the step uses and its token rows
  int64_t slot;
  std::vector<int64_t> rows;
};

std::vector<SlotRows> group_rows(const int64_t* token_slots, int64_t num_rows, int64_t num_slots) {
  std::vector<std::vector<int64_t>> rows_of(num_slots);
  for (int64_t t = 0; t < num_rows; ++t) rows_of[token_slots[t]].push_back(t);
  std::vector<SlotRows> groups;
  for (int64_t s = 0; s < num_slots; ++s)
    if (!rows_of[s].empty()) groups.push_back({s, std::move(rows_of[s])});
  return groups;  // slot 0's rows first, when there are any
}

// shrunk[row * width + j] = x[row] . a_row for M rows (one load of the A row for all of them)
template <int64_t M, typename T>
void dot_rows(const T* a_row, const T* x, int64_t in, const int64_t* rows, float* shrunk, int64_t width) {
  floatv acc[M] = {};
  const T* xs[M];
  for (int64_t k = 0; k < M; ++k) xs[k] = x + rows[k] * in;
  int64_t i = 0;
  for (; i + LANES <= in; i += LANES) {
    const floatv a = load(a_row + i);
    for (int64_t k = 0; k < M; ++k) acc[k] += a * load(xs[k] + i);
  }
  for (int64_t k = 0; k < M; ++k) {
    float sum = sum_lanes(acc[k]);
    for (int64_t c = i; c < in; ++c) sum += static_cast<float>(a_row[c]) * static_cast<float>(xs[k][c]);
    shrunk[rows[k] * width] = sum;
  }
}

template <typename T>
void shrink_rows(const T* a_row, const T* x, int64_t in, const std::vector<int64_t>& rows, float* shrunk,
                 int64_t width) {
  const int64_t n = static_cast<int64_t>(rows.size());
  int64_t r = 0;
  for (; r + MAX_BLOCK_ROWS <= n; r += MAX_BLOCK_ROWS)
    dot_rows<MAX_BLOCK_ROWS>(a_row, x, in, rows.data() + r, shrunk, width);
  switch (n - r) {
    case 3: dot_rows<3>(a_row, x, in, rows.data() + r, shrunk, width); break;
    case 2: dot_rows<2>(a_row, x, in, rows.data() + r, shrunk, width); break;
    case 1: dot_rows<1>(a_row, x, in, rows.data() + r, shrunk, width); break;
    default: break;
  }
}

struct ColumnChunk {  // output columns [begin, end) of slice `slice`
  int64_t slice, begin, end;
};

std::vector<ColumnChunk> column_chunks(const int64_t* slice_sizes, int64_t num_slices) {
  std::vector<ColumnChunk> chunks;
  int64_t offset = 0;
  for (int64_t i = 0; i < num_slices; ++i) {
    for (int64_t c = offset; c < offset + slice_sizes[i]; c += CHUNK)
      chunks.push_back({i, c, std::min(c + CHUNK, offset + slice_sizes[i])});
    offset += slice_sizes[i];
  }
  return chunks;
}

// dst[k][begin, begin + CHUNK) = coefficients[k] [rank] times b's rows [rank, out] in those columns, for M rows
// sharing each load of b
template <int64_t M, typename T>
void expand_chunk(const float* const* coefficients, const T* b, int64_t rank, int64_t out, int64_t begin,
                  T* const* dst) {
  floatv acc[M][4] = {};
  for (int64_t j = 0; j < rank; ++j) {
    const T* b_row = b + j * out + begin;
    for (int64_t v = 0; v < 4; ++v) {
      const floatv w = load(b_row + v * LANES);
      for (int64_t k = 0; k < M; ++k) acc[k][v] += coefficients[k][j] * w;
    }
  }
  for (int64_t k = 0; k < M; ++k)
    for (int64_t v = 0; v < 4; ++v) store(dst[k] + begin + v * LANES, acc[k][v]);
}

// the same for the columns [begin, end) of a chunk shorter than CHUNK (the last of a slice), one row
template <typename T>
void expand_tail(const float* coefficients, const T* b, int64_t rank, int64_t out, int64_t begin, int64_t end,
                 T* dst) {
  float acc[CHUNK] = {};
  for (int64_t j = 0; j < rank; ++j)
    for (int64_t c = begin; c < end; ++c) acc[c - begin] += coefficients[j] * static_cast<float>(b[j * out + c]);
  for (int64_t c = begin; c < end; ++c) dst[c] = static_cast<T>(acc[c - begin]);
}

// chunk's columns of the rows of one slot: shrunk rows [width] (this slice's coefficients from `offset`) times the
// slot's B of the slice
template <typename T>
void expand_rows(const ColumnChunk& chunk, const std::vector<int64_t>& rows, const float* shrunk, int64_t width,
                 int64_t offset, const T* b, int64_t rank, int64_t out, T* dst) {
  const int64_t n = static_cast<int64_t>(rows.size());
  int64_t r = 0;
  if (chunk.end - chunk.begin == CHUNK) {
    for (; r + 2 <= n; r += 2) {
      const float* coefficients[2] = {shrunk + rows[r] * width + offset, shrunk + rows[r + 1] * width + offset};
      T* const dsts[2] = {dst + rows[r] * out, dst + rows[r + 1] * out};
      expand_chunk<2>(coefficients, b, rank, out, chunk.begin, dsts);
    }
    if (r < n) {
      const float* coefficients[1] = {shrunk + rows[r] * width + offset};
      T* const dsts[1] = {dst + rows[r] * out};
      expand_chunk<1>(coefficients, b, rank, out, chunk.begin, dsts);
    }
    return;
  }
  for (; r < n; ++r)
    expand_tail(shrunk + rows[r] * width + offset, b, rank, out, chunk.begin, chunk.end, dst + rows[r] * out);
}

template <typename T>
void bgmv(const inferno::View& x, const inferno::View& lora_a, const inferno::View& lora_b,
          const inferno::View& token_slots, const int64_t* slice_sizes, int64_t num_slices,
          const inferno::View& out) {
  const int64_t num_rows = x.size(0), in = x.size(1), width = lora_a.size(1), out_features = lora_b.size(2);
  const int64_t rank = width / num_slices;
  const T* xs = x.data_ptr<T>();
  const T* a = lora_a.data_ptr<T>();
  const T* b = lora_b.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const std::vector<SlotRows> groups = group_rows(token_slots.data_ptr<int64_t>(), num_rows, lora_a.size(0));
  const bool has_base_rows = !groups.empty() && groups[0].slot == 0;
  const int64_t first_adapter = has_base_rows ? 1 : 0;
  const int64_t num_adapters = static_cast<int64_t>(groups.size()) - first_adapter;

  // shrink: one work item per (adapter in use, row of its A)
  std::vector<float> shrunk(num_rows * width);
  inferno::parallel_for(0, num_adapters * width, 4, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const SlotRows& group = groups[first_adapter + item / width];
      const int64_t j = item % width;
      shrink_rows(a + (group.slot * width + j) * in, xs, in, group.rows, shrunk.data() + j, width);
    }
  });

  // expand: one work item per chunk of a slice's columns, for every row (zeros for the rows without an adapter)
  const std::vector<ColumnChunk> chunks = column_chunks(slice_sizes, num_slices);
  inferno::parallel_for(0, static_cast<int64_t>(chunks.size()), 2, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const ColumnChunk& chunk = chunks[k];
      if (has_base_rows)
        for (int64_t t : groups[0].rows) {
          T* row = dst + t * out_features;
          std::fill(row + chunk.begin, row + chunk.end, T(0.f));
        }
      for (int64_t g = first_adapter; g < static_cast<int64_t>(groups.size()); ++g) {
        const T* slice_b = b + (groups[g].slot * width + chunk.slice * rank) * out_features;
        expand_rows(chunk, groups[g].rows, shrunk.data(), width, chunk.slice * rank, slice_b, rank, out_features,
                    dst);
      }
    }
  });
}

}  // namespace

namespace inferno::cpu {

void lora_bgmv(const View& x, const View& lora_a, const View& lora_b, const View& token_slots,
               const int64_t* slice_sizes, int64_t num_slices, const View& out) {
  dispatch_float_type(x.scalar_type(), [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    bgmv<T>(x, lora_a, lora_b, token_slots, slice_sizes, num_slices, out);
  });
}

}  // namespace inferno::cpu
