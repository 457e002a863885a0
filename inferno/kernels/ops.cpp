// Everything torch-facing of the native kernels, in one file compiled once and linked into every ISA level's
// library: the schemas of every `inferno::` operator, their CPU implementations (the tensors checked, the outputs
// made, then the kernel body of this library's level called through entry_points.h), and PyTorch's threads for the
// bodies (kernel.h). The operators' shapes for torch.compile are in inferno/kernels/fake_ops.py. TORCH_LIBRARY, not
// a fragment: a second kernel library in the same process (another ISA level's) fails loudly at load instead of
// replacing the first one's implementations.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstring>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>

#include "entry_points.h"

namespace inferno {

int64_t num_threads() { return at::get_num_threads(); }

void parallel_for(int64_t begin, int64_t end, int64_t grain, void (*chunk)(const void*, int64_t, int64_t),
                  const void* context) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { chunk(context, b, e); });
}

}  // namespace inferno

namespace {

using at::Tensor;
using inferno::View;
namespace cpu = inferno::cpu;
namespace gguf = inferno::gguf;

inferno::Dtype dtype_of(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return inferno::Dtype::Float;
    case at::kBFloat16: return inferno::Dtype::BFloat16;
    case at::kHalf: return inferno::Dtype::Half;
    case at::kByte: return inferno::Dtype::Byte;
    case at::kChar: return inferno::Dtype::Char;
    case at::kLong: return inferno::Dtype::Long;
    default: return inferno::Dtype::Other;
  }
}

View view(const Tensor& t) {
  TORCH_CHECK(t.dim() <= inferno::kMaxDims, "the native kernels take tensors of up to ", inferno::kMaxDims,
              " dimensions, got ", t.sizes());
  View v{t.data_ptr(), dtype_of(t.scalar_type()), t.dim()};
  for (int64_t d = 0; d < t.dim(); ++d) {
    v.sizes[d] = t.size(d);
    v.strides[d] = t.stride(d);
  }
  return v;
}

bool is_float_type(at::ScalarType type) { return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf; }

void check_float_type(at::ScalarType type, const char* name) {
  TORCH_CHECK(is_float_type(type), name, ": float32, bfloat16 or float16, got ", type);
}

void check_x(const Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be 2-D, float32, contiguous");
}

Tensor matmul_output(const Tensor& x, int64_t n) { return at::empty({x.size(0), n}, x.options()); }

Tensor dequantized(int64_t n, int64_t k, at::ScalarType dtype, const at::TensorOptions& options) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16, got ", dtype);
  return at::empty({n, k}, options.dtype(dtype));
}

// ---- attention (paged_attention.cpp, prefill_attention.cpp) ----

// q [B, H, D]; caches [KVH, num_blocks, block_size, D]; block_tables [B, W] int64; seq_lens [B] int64;
// D a multiple of 16, at most 256; window > 0: only the last `window` keys of each sequence; threads > 0: the threads
// a sequence's keys are split for (the engine's), else the calling thread's
Tensor paged_decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                              const Tensor& block_tables, const Tensor& seq_lens, double scale, int64_t window,
                              int64_t threads) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong, "block_tables: int64");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.scalar_type() == at::kLong, "seq_lens: int64");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "the K and V caches must have one dtype");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() || (q.scalar_type() == at::kFloat &&
                                                           k_cache.scalar_type() == at::kHalf),
              "q and the caches must have one dtype (or a float32 q with float16 caches)");
  check_float_type(q.scalar_type(), "paged_decode_attention");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) <= 256, "head_dim must be a multiple of 16 up to 256, got ", q.size(2));
  auto out = at::empty_like(q);
  cpu::paged_decode_attention(view(q), view(k_cache), view(v_cache), view(block_tables), view(seq_lens), scale, window,
                              threads > 0 ? threads : inferno::num_threads(), view(out));
  return out;
}

// query_start [S + 1] (row offsets, from 0 to q's `num_rows`, never decreasing) and seq_lens [S] (tokens cached
// before each chunk plus its own), each chunk with its row of block_tables [S, W] covering its positions
void check_packed_chunks(const Tensor& query_start, const Tensor& seq_lens, const Tensor& block_tables,
                         int64_t num_rows, int64_t block_size) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong,
              "block_tables: [chunks, width] int64");
  const int64_t num_chunks = block_tables.size(0), width = block_tables.size(1);
  TORCH_CHECK(query_start.dim() == 1 && query_start.size(0) == num_chunks + 1 && seq_lens.dim() == 1 &&
              seq_lens.size(0) == num_chunks, "query_start [chunks + 1], seq_lens [chunks], block_tables [chunks, width]");
  TORCH_CHECK(query_start.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "query_start, seq_lens: int64");
  const int64_t *starts = query_start.data_ptr<int64_t>(), *lens = seq_lens.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_chunks] == num_rows, "query_start must run from 0 to q's ", num_rows,
              " rows");
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t n = starts[c + 1] - starts[c];
    TORCH_CHECK(n >= 0 && lens[c] >= n, "chunk ", c, ": query_start must not decrease and seq_lens must count the "
                "chunk's tokens");
    TORCH_CHECK(width * block_size >= lens[c], "chunk ", c, ": the block table must cover every position of the chunk");
  }
}

// q [N, H, D]: the packed chunks' queries (the heads of a position contiguous, head_dim contiguous, rows at any
// stride); chunk c's rows are query_start[c] .. query_start[c + 1], at positions seq_lens[c] - its length onward;
// k, v [N, KVH, D] (head_dim contiguous): the chunks' K/V as computed, also written to the caches
// [KVH, num_blocks, block_size, D], which hold the context before each chunk; block_tables [S, W] int64, row c
// covering chunk c's positions; D a multiple of 16; window > 0: each query sees only the last `window` keys up to
// itself. The output is [N, H, D], contiguous.
Tensor paged_prefill_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                               const Tensor& v_cache, const Tensor& block_tables, const Tensor& query_start,
                               const Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.size(2) == k_cache.size(3), "q [n, H, D], caches [KVH, B, S, D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q: the heads of a position contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(1) == k_cache.size(0) &&
              k.size(2) == q.size(2) && k.stride(2) == 1 && v.stride(2) == 1,
              "k, v: the chunks' [n, KVH, D], head_dim contiguous");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "k, v: q's dtype");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "the K and V caches must have one dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "query heads must be a multiple of the kv heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() || (q.scalar_type() == at::kFloat &&
                                                           k_cache.scalar_type() == at::kHalf),
              "q and the caches must have one dtype (or a float32 q with float16 caches)");
  check_float_type(q.scalar_type(), "paged_prefill_attention");
  TORCH_CHECK(q.size(2) % 16 == 0, "head_dim must be a multiple of 16, got ", q.size(2));
  const Tensor starts = query_start.contiguous(), lens = seq_lens.contiguous();
  check_packed_chunks(starts, lens, block_tables, q.size(0), k_cache.size(2));
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  cpu::paged_prefill_attention(view(q), view(k), view(v), view(k_cache), view(v_cache), view(block_tables),
                               view(starts), view(lens), scale, window, view(out));
  return out;
}

// ---- group-wise int8, Q8 groups and int4 weights (quantized_gemv.cpp) ----

void check_weight(const Tensor& codes, const Tensor& scales, const Tensor& mins, int64_t group_size) {
  TORCH_CHECK(codes.dim() == 2 && scales.dim() == 2 && mins.dim() == 2, "codes, scales and mins must be 2-D");
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kFloat && mins.scalar_type() == at::kFloat,
              "scales and mins must be float32 and codes uint8");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && mins.is_contiguous(),
              "codes, scales and mins must be contiguous");
  TORCH_CHECK(group_size > 0, "group_size must be positive, got ", group_size);
  const int64_t n = codes.size(0), k = codes.size(1), groups = (k + group_size - 1) / group_size;
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == groups && mins.sizes() == scales.sizes(),
              "scales and mins must be [", n, ", ", groups, "] for ", k, " columns in groups of ", group_size);
}

// x [M, K] float32; codes [N, K] uint8; scales, mins [N, ceil(K / group_size)] float32 -> [M, N] float32
Tensor int8_group_matmul(const Tensor& x, const Tensor& codes, const Tensor& scales, const Tensor& mins,
                         int64_t group_size) {
  check_x(x);
  check_weight(codes, scales, mins, group_size);
  TORCH_CHECK(codes.size(1) == x.size(1), "x has ", x.size(1), " columns but codes have ", codes.size(1));
  auto y = matmul_output(x, codes.size(0));
  cpu::int8_group_matmul(view(x), view(codes), view(scales), view(mins), group_size, view(y));
  return y;
}

// codes [N, K] uint8; scales, mins [N, ceil(K / group_size)] float32 -> W [N, K] float32 (for a dense GEMM)
Tensor int8_group_dequantize(const Tensor& codes, const Tensor& scales, const Tensor& mins, int64_t group_size) {
  check_weight(codes, scales, mins, group_size);
  auto w = at::empty({codes.size(0), codes.size(1)}, scales.options());
  cpu::int8_group_dequantize(view(codes), view(scales), view(mins), group_size, view(w));
  return w;
}

void check_q8_weight(const Tensor& codes, const Tensor& scales, const std::optional<Tensor>& mins,
                     int64_t group_size) {
  TORCH_CHECK(group_size == 16 || group_size == 32, "group_size must be 16 or 32, got ", group_size);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.size(1) % 32 == 0,
              "codes must be 2-D, int8, contiguous, a multiple of 32 columns");
  const int64_t n = codes.size(0), groups = codes.size(1) / group_size;
  for (const Tensor* t : {&scales, mins ? &*mins : nullptr})
    TORCH_CHECK(t == nullptr || (t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                                 t->size(0) == n && t->size(1) == groups),
                "scales and mins must be float32 [", n, ", ", groups, "]");
}

// x [M, K] float32; codes [N, K] int8; scales, mins [N, K / group_size] float32 -> [M, N] float32
Tensor int8_q8_matmul(const Tensor& x, const Tensor& codes, const Tensor& scales, const std::optional<Tensor>& mins,
                      int64_t group_size) {
  check_x(x);
  check_q8_weight(codes, scales, mins, group_size);
  TORCH_CHECK(codes.size(1) == x.size(1), "x has ", x.size(1), " columns but codes have ", codes.size(1));
  auto y = matmul_output(x, codes.size(0));
  const std::optional<View> min_view = mins ? std::optional<View>(view(*mins)) : std::nullopt;
  cpu::int8_q8_matmul(view(x), view(codes), view(scales), min_view ? &*min_view : nullptr, group_size, view(y));
  return y;
}

// codes [N, K] int8; scales, mins [N, K / group_size] float32 -> W [N, K] = codes * scales (+ mins) in `dtype`
Tensor int8_q8_dequantize(const Tensor& codes, const Tensor& scales, const std::optional<Tensor>& mins,
                          int64_t group_size, at::ScalarType dtype) {
  check_q8_weight(codes, scales, mins, group_size);
  auto w = dequantized(codes.size(0), codes.size(1), dtype, scales.options());
  const std::optional<View> min_view = mins ? std::optional<View>(view(*mins)) : std::nullopt;
  cpu::int8_q8_dequantize(view(codes), view(scales), min_view ? &*min_view : nullptr, group_size, view(w));
  return w;
}

void check_int4_rows(const Tensor& packed, int64_t k, int64_t group_size) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(1) == inferno::int4_row_bytes(k, group_size),
              "packed must be uint8 [N, ", inferno::int4_row_bytes(k, group_size), "] for ", k, " columns");
}

// x [M, K] float32, K a multiple of group_size (32, 64 or 128); packed [N, int4_row_bytes] uint8 (the int4 layout
// of quantized_gemv.cpp, its second float16 per group a zero point when `zero_points`) -> [M, N] float32
Tensor int4_q8_matmul(const Tensor& x, const Tensor& packed, int64_t group_size, bool zero_points) {
  check_x(x);
  TORCH_CHECK(group_size == 32 || group_size == 64 || group_size == 128, "group_size must be 32, 64 or 128, got ",
              group_size);
  TORCH_CHECK(x.size(1) % group_size == 0, "x needs a multiple of group_size columns, got ", x.size(1));
  check_int4_rows(packed, x.size(1), group_size);
  auto y = matmul_output(x, packed.size(0));
  cpu::int4_q8_matmul(view(x), view(packed), group_size, zero_points, view(y));
  return y;
}

void check_int4_groups(int64_t k, int64_t group_size) {
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && k % group_size == 0,
              "group_size must be a multiple of 32 and k of group_size, got ", group_size, " and ", k);
}

// packed [N, int4_row_bytes] uint8 -> W [N, K] in `dtype`, w = code * d + min computed in float32
Tensor int4_dequantize(const Tensor& packed, int64_t k, int64_t group_size, at::ScalarType dtype, bool zero_points) {
  check_int4_groups(k, group_size);
  check_int4_rows(packed, k, group_size);
  auto w = dequantized(packed.size(0), k, dtype, packed.options());
  cpu::int4_dequantize(view(packed), k, group_size, zero_points, view(w));
  return w;
}

void check_tile_rows(int64_t n, const char* type) {
  TORCH_CHECK(n % inferno::TILE_ROWS == 0, type, " tiles take a multiple of ", inferno::TILE_ROWS, " rows, got ", n);
}

// packed [N, int4_row_bytes] uint8 (N a multiple of 16) -> tiles [N / 16, K / 32 * 320] uint8
Tensor int4_tile(const Tensor& packed, int64_t k, int64_t group_size) {
  check_int4_groups(k, group_size);
  check_int4_rows(packed, k, group_size);
  check_tile_rows(packed.size(0), "int4");
  auto tiles = at::empty({packed.size(0) / inferno::TILE_ROWS, k / 32 * inferno::INT4_TILE_BLOCK_BYTES},
                         packed.options());
  cpu::int4_tile(view(packed), k, group_size, view(tiles));
  return tiles;
}

// x [M, K] float32 times tiles [N / 16, K / span * tile_block_bytes] uint8: checked, and y [M, N] float32 made
Tensor tiles_output(const Tensor& x, const Tensor& tiles, int64_t tile_block_bytes, int64_t span, const char* type) {
  check_x(x);
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
              tiles.size(1) % tile_block_bytes == 0,
              "tiles must be contiguous uint8 [N / 16, K / ", span, " * ", tile_block_bytes, "] (", type,
              " tiles), got ", tiles.scalar_type(), " ", tiles.sizes());
  TORCH_CHECK(x.size(1) % span == 0 && tiles.size(1) == x.size(1) / span * tile_block_bytes, "x has ", x.size(1),
              " columns but the tiles hold ", tiles.size(1) / tile_block_bytes * span);
  return matmul_output(x, tiles.size(0) * inferno::TILE_ROWS);
}

// x [M, K] float32; tiles [N / 16, K / 32 * 320] uint8 (int4_tile) -> [M, N] float32, the sums of int4_q8_matmul
Tensor int4_tiles_matmul(const Tensor& x, const Tensor& tiles, bool zero_points) {
  auto y = tiles_output(x, tiles, inferno::INT4_TILE_BLOCK_BYTES, 32, "int4");
  cpu::int4_tiles_matmul(view(x), view(tiles), zero_points, view(y));
  return y;
}

// codes [N, K] int8 (N a multiple of 16, K of 32), scales [N, K / 32] float32 -> tiles [N / 16, K / 32 * 576] uint8
Tensor q8_tile(const Tensor& codes, const Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.size(1) % 32 == 0,
              "codes must be 2-D, int8, contiguous, a multiple of 32 columns");
  const int64_t n = codes.size(0), blocks = codes.size(1) / 32;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
              scales.size(0) == n && scales.size(1) == blocks, "scales must be float32 [", n, ", ", blocks, "]");
  check_tile_rows(n, "Q8");
  auto tiles = at::empty({n / inferno::TILE_ROWS, blocks * inferno::Q8_TILE_BLOCK_BYTES}, codes.options().dtype(at::kByte));
  cpu::q8_tile(view(codes), view(scales), view(tiles));
  return tiles;
}

// x [M, K] float32; tiles [N / 16, K / 32 * 576] uint8 (q8_tile) -> [M, N] float32, the sums of int8_q8_matmul
Tensor q8_tiles_matmul(const Tensor& x, const Tensor& tiles) {
  auto y = tiles_output(x, tiles, inferno::Q8_TILE_BLOCK_BYTES, 32, "Q8");
  cpu::q8_tiles_matmul(view(x), view(tiles), view(y));
  return y;
}

// codes [N, K] int8 in [-16, 15] (N a multiple of 16, K of 32), scales [N, K / 32] float32 holding float16 values (the
// GGUF Q5_0 block as Q8Groups) -> tiles [N / 16, K / 32 * 352] uint8
Tensor q5_tile(const Tensor& codes, const Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.size(1) % 32 == 0,
              "codes must be 2-D, int8, contiguous, a multiple of 32 columns");
  const int64_t n = codes.size(0), blocks = codes.size(1) / 32;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
              scales.size(0) == n && scales.size(1) == blocks, "scales must be float32 [", n, ", ", blocks, "]");
  check_tile_rows(n, "Q5");
  auto tiles = at::empty({n / inferno::TILE_ROWS, blocks * inferno::Q5_TILE_BLOCK_BYTES},
                         codes.options().dtype(at::kByte));
  TORCH_CHECK(cpu::q5_tile(view(codes), view(scales), view(tiles)),
              "Q5 tiles take codes in [-16, 15] and float16 scales");
  return tiles;
}

// x [M, K] float32; tiles [N / 16, K / 32 * 352] uint8 (q5_tile) -> [M, N] float32
Tensor q5_tiles_matmul(const Tensor& x, const Tensor& tiles) {
  auto y = tiles_output(x, tiles, inferno::Q5_TILE_BLOCK_BYTES, 32, "Q5");
  cpu::q5_tiles_matmul(view(x), view(tiles), view(y));
  return y;
}

// ---- K-quant super-blocks (q4_k_gemv.cpp, q6_k_gemv.cpp): 256 weights in `block_bytes` bytes ----

void check_super_blocks(const Tensor& blocks, int64_t block_bytes, const char* type) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
              blocks.size(1) % block_bytes == 0,
              "blocks must be contiguous uint8 [N, K / 256 * ", block_bytes, "] (", type, " super-blocks), got ",
              blocks.scalar_type(), " ", blocks.sizes());
}

// x [M, K] float32 times blocks [N, K / 256 * block_bytes] uint8: checked, and y [M, N] float32 made
Tensor super_block_output(const Tensor& x, const Tensor& blocks, int64_t block_bytes, const char* type) {
  check_x(x);
  check_super_blocks(blocks, block_bytes, type);
  const int64_t k = x.size(1);
  TORCH_CHECK(k % 256 == 0 && blocks.size(1) == k / 256 * block_bytes, "x has ", k, " columns but the blocks hold ",
              blocks.size(1) / block_bytes * 256);
  return matmul_output(x, blocks.size(0));
}

// blocks [N, K / 256 * block_bytes] uint8 -> W [N, K] in `dtype`
Tensor super_block_weight(const Tensor& blocks, int64_t block_bytes, at::ScalarType dtype, const char* type) {
  check_super_blocks(blocks, block_bytes, type);
  return dequantized(blocks.size(0), blocks.size(1) / block_bytes * 256, dtype, blocks.options());
}

// blocks [N, K / 256 * block_bytes] uint8, N a multiple of 16 -> tiles [N / 16, K / 256 * tile_block_bytes] uint8
Tensor super_block_tiles(const Tensor& blocks, int64_t block_bytes, int64_t tile_block_bytes, const char* type) {
  check_super_blocks(blocks, block_bytes, type);
  check_tile_rows(blocks.size(0), type);
  return at::empty({blocks.size(0) / inferno::TILE_ROWS, blocks.size(1) / block_bytes * tile_block_bytes},
                   blocks.options());
}

Tensor q4_k_matmul(const Tensor& x, const Tensor& blocks) {
  auto y = super_block_output(x, blocks, inferno::Q4K_BLOCK_BYTES, "Q4_K");
  cpu::q4_k_matmul(view(x), view(blocks), view(y));
  return y;
}

// w = (d * sc) * q - (dmin * m) in float32 (as gguf.quants.dequantize computes it), rounded once to `dtype`
Tensor q4_k_dequantize(const Tensor& blocks, at::ScalarType dtype) {
  auto w = super_block_weight(blocks, inferno::Q4K_BLOCK_BYTES, dtype, "Q4_K");
  cpu::q4_k_dequantize(view(blocks), view(w));
  return w;
}

Tensor q4_k_tile(const Tensor& blocks) {
  auto tiles = super_block_tiles(blocks, inferno::Q4K_BLOCK_BYTES, inferno::Q4K_TILE_BLOCK_BYTES, "Q4_K");
  cpu::q4_k_tile(view(blocks), view(tiles));
  return tiles;
}

// the sums of q4_k_matmul
Tensor q4_k_tiles_matmul(const Tensor& x, const Tensor& tiles) {
  auto y = tiles_output(x, tiles, inferno::Q4K_TILE_BLOCK_BYTES, 256, "Q4_K");
  cpu::q4_k_tiles_matmul(view(x), view(tiles), view(y));
  return y;
}

Tensor q6_k_matmul(const Tensor& x, const Tensor& blocks) {
  auto y = super_block_output(x, blocks, inferno::Q6K_BLOCK_BYTES, "Q6_K");
  cpu::q6_k_matmul(view(x), view(blocks), view(y));
  return y;
}

// w = (d * sc) * (q - 32) in float32 (as gguf.quants.dequantize computes it), rounded once to `dtype`
Tensor q6_k_dequantize(const Tensor& blocks, at::ScalarType dtype) {
  auto w = super_block_weight(blocks, inferno::Q6K_BLOCK_BYTES, dtype, "Q6_K");
  cpu::q6_k_dequantize(view(blocks), view(w));
  return w;
}

Tensor q6_k_tile(const Tensor& blocks) {
  auto tiles = super_block_tiles(blocks, inferno::Q6K_BLOCK_BYTES, inferno::Q6K_TILE_BLOCK_BYTES, "Q6_K");
  cpu::q6_k_tile(view(blocks), view(tiles));
  return tiles;
}

// the sums of q6_k_matmul
Tensor q6_k_tiles_matmul(const Tensor& x, const Tensor& tiles) {
  auto y = tiles_output(x, tiles, inferno::Q6K_TILE_BLOCK_BYTES, 256, "Q6_K");
  cpu::q6_k_tiles_matmul(view(x), view(tiles), view(y));
  return y;
}

// ---- GGUF repacking at load (gguf_repack.cpp) ----

// Checks raw GGUF rows [rows, bytes per row] (contiguous rows) of `qtype` and returns the type's blocks.
gguf::Blocks check_raw(const Tensor& raw, int64_t qtype) {
  const gguf::Blocks t = gguf::blocks_of(qtype);
  TORCH_CHECK(t.block_bytes > 0, "GGUF tensor type ", qtype, " has no native repacking");
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.stride(1) == 1,
              "raw blocks must be uint8 [rows, bytes per row] with contiguous rows");
  TORCH_CHECK(raw.size(1) % t.block_bytes == 0, "a row of ", raw.size(1), " bytes is not a whole number of ",
              t.block_bytes, "-byte blocks");
  return t;
}

// Q4_0 / Q4_1 rows -> the int4 layout, written into `packed` (uint8 [rows, K / 2 + 4 * K / 32], contiguous): a
// fused layer's shards go straight into their rows of one tensor.
void gguf_to_int4(const Tensor& raw, int64_t qtype, Tensor& packed) {
  TORCH_CHECK(qtype == gguf::Q4_0 || qtype == gguf::Q4_1, "gguf_to_int4 takes Q4_0 or Q4_1, got type ", qtype);
  const gguf::Blocks t = check_raw(raw, qtype);
  const int64_t rows = raw.size(0), k = raw.size(1) / t.block_bytes * t.block_values;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(0) == rows && packed.size(1) == inferno::int4_row_bytes(k, 32),
              "packed must be contiguous uint8 [", rows, ", ", inferno::int4_row_bytes(k, 32), "]");
  cpu::gguf_to_int4(view(raw), qtype, view(packed));
}

// raw rows of qtype -> Q8Groups' codes [rows, K] int8, scales [rows, K / G] float32 and mins (the same, or empty for
// the symmetric types)
std::tuple<Tensor, Tensor, Tensor> gguf_to_q8(const Tensor& raw, int64_t qtype) {
  const gguf::Blocks t = check_raw(raw, qtype);
  const int64_t rows = raw.size(0), k = raw.size(1) / t.block_bytes * t.block_values;
  const int64_t groups = k / gguf::q8_group(qtype);
  auto floats = raw.options().dtype(at::kFloat);
  Tensor codes = at::empty({rows, k}, raw.options().dtype(at::kChar));
  Tensor scales = at::empty({rows, groups}, floats);
  Tensor mins = gguf::q8_has_mins(qtype) ? at::empty({rows, groups}, floats) : at::empty({0}, floats);
  cpu::gguf_to_q8(view(raw), qtype, view(codes), view(scales), view(mins));
  return {codes, scales, mins};
}

// `count` strings from byte `pos` of `bytes` (uint8), each a u64 little-endian length and that many bytes -> int64
// [count + 1]: where each string's bytes start, then the position after the last one (the sequential walk Python
// would spend a loop iteration per string on). A string running past the end of `bytes` is an error.
Tensor gguf_string_offsets(const Tensor& bytes, int64_t pos, int64_t count) {
  TORCH_CHECK(bytes.dim() == 1 && bytes.scalar_type() == at::kByte && bytes.is_contiguous(),
              "bytes must be 1-D contiguous uint8");
  TORCH_CHECK(pos >= 0 && count >= 0, "pos and count must not be negative");
  const uint8_t* data = bytes.data_ptr<uint8_t>();
  const uint64_t size = static_cast<uint64_t>(bytes.numel());
  auto offsets = at::empty({count + 1}, at::kLong);
  int64_t* out = offsets.data_ptr<int64_t>();
  uint64_t here = static_cast<uint64_t>(pos);
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(here <= size && size - here >= 8, "a string array runs past the end of the file");
    uint64_t length;
    std::memcpy(&length, data + here, sizeof(length));
    here += 8;
    TORCH_CHECK(length <= size - here, "a string array runs past the end of the file");
    out[i] = static_cast<int64_t>(here);
    here += length;
  }
  out[count] = static_cast<int64_t>(here);
  return offsets;
}

// ---- W8A8 activations (w8a8_activations.cpp) ----

// x [M, K] float32 or bfloat16; input_scales [K] float32 or None; rotation_block 0 (none) or a power of two
// dividing K -> (codes [M, K] uint8, row scales [M, 1] float32)
std::tuple<Tensor, Tensor> w8a8_quantize_rows(const Tensor& x, const std::optional<Tensor>& input_scales,
                                              int64_t rotation_block) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: a contiguous [M, K] matrix");
  const int64_t k = x.size(1);
  TORCH_CHECK(rotation_block == 0 || (rotation_block > 0 && (rotation_block & (rotation_block - 1)) == 0 &&
                                      k % rotation_block == 0),
              "rotation_block must be 0 or a power of two dividing ", k, ", got ", rotation_block);
  const float* scales = nullptr;
  if (input_scales.has_value()) {
    TORCH_CHECK(input_scales->scalar_type() == at::kFloat && input_scales->is_contiguous() &&
                input_scales->numel() == k, "input_scales: ", k, " float32 values");
    scales = input_scales->data_ptr<float>();
  }
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "w8a8_quantize_rows: float32 or bfloat16 rows, got ", x.scalar_type());
  auto codes = at::empty({x.size(0), k}, x.options().dtype(at::kByte));
  auto row_scales = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
  cpu::w8a8_quantize_rows(view(x), scales, rotation_block, view(codes), view(row_scales));
  return {codes, row_scales};
}

// out = y * row_scales + bias: y [M, N] float32 (the integer GEMM's output), row_scales [M, 1] float32, bias [N]
// float32 or None; out float32 (y itself allowed) or bfloat16, [M, N]
void w8a8_scale_rows(const Tensor& y, const Tensor& row_scales, const std::optional<Tensor>& bias, Tensor& out) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat, "y: a contiguous float32 [M, N]");
  TORCH_CHECK(out.sizes() == y.sizes() && out.is_contiguous(), "out: a contiguous tensor of y's shape");
  TORCH_CHECK(row_scales.is_contiguous() && row_scales.scalar_type() == at::kFloat && row_scales.numel() == y.size(0),
              "row_scales: one float32 per row");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == y.size(1),
                "bias: one float32 per column");
    b = bias->data_ptr<float>();
  }
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "w8a8_scale_rows: float32 or bfloat16 out, got ", out.scalar_type());
  cpu::w8a8_scale_rows(view(y), row_scales.data_ptr<float>(), b, view(out));
}

// ---- fused elementwise steps (fused_ops.cpp) ----

void check_norm(const Tensor& x, const Tensor& weight, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: a contiguous [T, size] matrix");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight: one value per column, in x's dtype");
  check_float_type(x.scalar_type(), name);
}

// x [T, size] contiguous, weight [size] of x's dtype -> rms_norm(x) * weight
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_norm(x, weight, "rms_norm");
  auto out = at::empty_like(x);
  cpu::rms_norm(view(x), view(weight), eps, view(out));
  return out;
}

// x, residual [T, size] contiguous, weight [size], all of one dtype -> (rms_norm(x + residual) * weight, x + residual)
std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
  check_norm(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "residual: like x");
  auto out = at::empty_like(x), sum = at::empty_like(x);
  cpu::add_rms_norm(view(x), view(residual), view(weight), eps, view(out), view(sum));
  return {out, sum};
}

// gate_up [T, 2 * inner] (gate, then up) -> silu(gate) * up [T, inner]
Tensor silu_and_mul(const Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up: a contiguous [T, 2 * inner] matrix");
  check_float_type(gate_up.scalar_type(), "silu_and_mul");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  cpu::silu_and_mul(view(gate_up), view(out));
  return out;
}

// x [T, heads, head_dim] (head_dim contiguous; interleaved pairs) rotated by rotations [T, 1, head_dim / 2, 2]
// float32 (cos, sin of each pair's angle), into a new contiguous tensor (a copy, not in place: a compiled step calls
// it too, and in-place ops on views do not trace)
Tensor rotary(const Tensor& x, const Tensor& rotations) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x: [T, heads, head_dim], head_dim contiguous");
  TORCH_CHECK(rotations.is_contiguous() && rotations.scalar_type() == at::kFloat &&
              rotations.numel() == x.size(0) * x.size(2), "rotations: [T, 1, head_dim / 2, 2] float32");
  check_float_type(x.scalar_type(), "rotary");
  Tensor out = at::empty(x.sizes(), x.options());
  cpu::rotary(view(x), view(rotations), view(out));
  return out;
}

// ---- bfloat16 and float32 linear layers on oneDNN's prepacked weights (inferno/layers/packed_linear.py) ----

// The copies, by the address of the weight each was made from. Here rather than in Python so that a compiled step's
// C++ wrapper calls `dense_linear` without going back to Python.
std::mutex packed_mutex;
std::unordered_map<int64_t, Tensor>& packed_weights() {
  static std::unordered_map<int64_t, Tensor> copies;
  return copies;
}

Tensor packed_copy(const Tensor& weight) {
  std::lock_guard<std::mutex> lock(packed_mutex);
  auto it = packed_weights().find(reinterpret_cast<int64_t>(weight.data_ptr()));
  return it == packed_weights().end() ? Tensor() : it->second;
}

// oneDNN's copy of weight [N, K] (bfloat16 or float32, contiguous), laid out for a decode step's few rows
void pack_linear_weight(const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
              (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
              "pack_linear_weight: a contiguous bfloat16 or float32 [N, K] weight");
  static auto reorder = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_reorder_linear_weight", "");
  // the batch size oneDNN lays the copy out for: float32 copies made for 16 rows run 1, 16 and 64 rows 15-45 %
  // faster than those made for one (2 Zen 5 cores); bfloat16 ones alike at either, and made for one give F.linear's
  // bits
  const int64_t rows = weight.scalar_type() == at::kFloat ? 16 : 1;
  torch::jit::Stack stack{weight, rows};
  reorder.callBoxed(&stack);
  std::lock_guard<std::mutex> lock(packed_mutex);
  packed_weights()[reinterpret_cast<int64_t>(weight.data_ptr())] = stack[0].toTensor();
}

// the copy of the weight that was at `address` dropped (its weight is gone); whether there was one
bool drop_packed_linear_weight(int64_t address) {
  std::lock_guard<std::mutex> lock(packed_mutex);
  return packed_weights().erase(address) > 0;
}

bool is_packed_linear_weight(const Tensor& weight) { return packed_copy(weight).defined(); }

// F.linear(x, weight, bias), on weight's packed copy where there is one (bfloat16: the same oneDNN kernel as
// F.linear, the same bits; float32: oneDNN's kernel where F.linear calls MKL's, equal up to float32 rounding)
Tensor dense_linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  Tensor packed = packed_copy(weight);
  if (!packed.defined()) return at::linear(x, weight, bias);
  static auto pointwise = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          c10::IValue()};
  pointwise.callBoxed(&stack);
  return stack[0].toTensor();
}

// ---- the LoRA product of a step's rows (lora_bgmv.cpp) ----

// x [T, in]; lora_a [slots, slices * rank, in] and lora_b [slots, slices * rank, out] (layers/lora.py's LoRAStack:
// slice i's A in rows i * rank.., its B transposed in those rows and in its own columns, from the sum of the
// slice_sizes before it), all of one float dtype and contiguous; token_slots [T] int64, each in [0, slots) ->
// out [T, out] in x's dtype: row t = (x[t] A[s]^T) B[s] for s = token_slots[t], zero where s = 0
Tensor lora_bgmv(const Tensor& x, const Tensor& lora_a, const Tensor& lora_b, const Tensor& token_slots,
                 at::IntArrayRef slice_sizes) {
  TORCH_CHECK(x.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3, "x [T, in], lora_a and lora_b [slots, width, *]");
  TORCH_CHECK(x.is_contiguous() && lora_a.is_contiguous() && lora_b.is_contiguous(), "x, lora_a, lora_b: contiguous");
  TORCH_CHECK(lora_a.scalar_type() == x.scalar_type() && lora_b.scalar_type() == x.scalar_type(),
              "x, lora_a and lora_b must have one dtype");
  check_float_type(x.scalar_type(), "lora_bgmv");
  const int64_t num_slices = static_cast<int64_t>(slice_sizes.size()), width = lora_a.size(1);
  TORCH_CHECK(num_slices > 0 && width % num_slices == 0, "lora_a's ", width, " rows are not ", num_slices,
              " slices of one rank");
  int64_t out_features = 0;
  for (int64_t size : slice_sizes) {
    TORCH_CHECK(size > 0, "slice sizes must be positive, got ", slice_sizes);
    out_features += size;
  }
  TORCH_CHECK(lora_a.size(2) == x.size(1), "x has ", x.size(1), " columns but lora_a ", lora_a.size(2));
  TORCH_CHECK(lora_b.size(0) == lora_a.size(0) && lora_b.size(1) == width && lora_b.size(2) == out_features,
              "lora_b must be [", lora_a.size(0), ", ", width, ", ", out_features, "], got ", lora_b.sizes());
  TORCH_CHECK(token_slots.dim() == 1 && token_slots.size(0) == x.size(0) && token_slots.is_contiguous() &&
              token_slots.scalar_type() == at::kLong, "token_slots: one int64 per row of x");
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < lora_a.size(0), "token_slots[", t, "] = ", slots[t], " is not a slot of ",
                lora_a.size(0));
  auto out = at::empty({x.size(0), out_features}, x.options());
  cpu::lora_bgmv(view(x), view(lora_a), view(lora_b), view(token_slots), slice_sizes.data(), num_slices, view(out));
  return out;
}

}  // namespace

TORCH_LIBRARY(inferno, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window=0, int threads=0) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start, Tensor seq_lens, float scale, int window=0) -> Tensor");

  m.def("int8_group_matmul(Tensor x, Tensor codes, Tensor scales, Tensor mins, int group_size) -> Tensor");
  m.def("int8_group_dequantize(Tensor codes, Tensor scales, Tensor mins, int group_size) -> Tensor");
  m.def("int8_q8_matmul(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int group_size) -> Tensor");
  m.def("int4_q8_matmul(Tensor x, Tensor packed, int group_size, bool zero_points=False) -> Tensor");
  m.def("int4_dequantize(Tensor packed, int k, int group_size, ScalarType dtype, bool zero_points=False) -> Tensor");
  m.def("int8_q8_dequantize(Tensor codes, Tensor scales, Tensor? mins, int group_size, ScalarType dtype) -> Tensor");
  m.def("int4_tile(Tensor packed, int k, int group_size) -> Tensor");
  m.def("int4_tiles_matmul(Tensor x, Tensor tiles, bool zero_points=False) -> Tensor");
  m.def("q8_tile(Tensor codes, Tensor scales) -> Tensor");
  m.def("q8_tiles_matmul(Tensor x, Tensor tiles) -> Tensor");
  m.def("q5_tile(Tensor codes, Tensor scales) -> Tensor");
  m.def("q5_tiles_matmul(Tensor x, Tensor tiles) -> Tensor");

  m.def("q4_k_matmul(Tensor x, Tensor blocks) -> Tensor");
  m.def("q4_k_dequantize(Tensor blocks, ScalarType dtype) -> Tensor");
  m.def("q4_k_tile(Tensor blocks) -> Tensor");
  m.def("q4_k_tiles_matmul(Tensor x, Tensor tiles) -> Tensor");
  m.def("q6_k_matmul(Tensor x, Tensor blocks) -> Tensor");
  m.def("q6_k_dequantize(Tensor blocks, ScalarType dtype) -> Tensor");
  m.def("q6_k_tile(Tensor blocks) -> Tensor");
  m.def("q6_k_tiles_matmul(Tensor x, Tensor tiles) -> Tensor");

  m.def("gguf_string_offsets(Tensor bytes, int pos, int count) -> Tensor");
  m.def("gguf_to_int4(Tensor raw, int qtype, Tensor(a!) packed) -> ()");
  m.def("gguf_to_q8(Tensor raw, int qtype) -> (Tensor, Tensor, Tensor)");

  m.def("w8a8_quantize_rows(Tensor x, Tensor? input_scales, int rotation_block) -> (Tensor, Tensor)");
  m.def("w8a8_scale_rows(Tensor y, Tensor row_scales, Tensor? bias, Tensor(a!) out) -> ()");

  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor x, Tensor rotations) -> Tensor");

  m.def("lora_bgmv(Tensor x, Tensor lora_a, Tensor lora_b, Tensor token_slots, int[] slice_sizes) -> Tensor");

  m.def("pack_linear_weight(Tensor weight) -> ()");
  m.def("drop_packed_linear_weight(int address) -> bool");
  m.def("is_packed_linear_weight(Tensor weight) -> bool");
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(inferno, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("int8_group_matmul", &int8_group_matmul);
  m.impl("int8_group_dequantize", &int8_group_dequantize);
  m.impl("int8_q8_matmul", &int8_q8_matmul);
  m.impl("int4_q8_matmul", &int4_q8_matmul);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("int8_q8_dequantize", &int8_q8_dequantize);
  m.impl("int4_tile", &int4_tile);
  m.impl("int4_tiles_matmul", &int4_tiles_matmul);
  m.impl("q8_tile", &q8_tile);
  m.impl("q8_tiles_matmul", &q8_tiles_matmul);
  m.impl("q5_tile", &q5_tile);
  m.impl("q5_tiles_matmul", &q5_tiles_matmul);
  m.impl("q4_k_matmul", &q4_k_matmul);
  m.impl("q4_k_dequantize", &q4_k_dequantize);
  m.impl("q4_k_tile", &q4_k_tile);
  m.impl("q4_k_tiles_matmul", &q4_k_tiles_matmul);
  m.impl("q6_k_matmul", &q6_k_matmul);
  m.impl("q6_k_dequantize", &q6_k_dequantize);
  m.impl("q6_k_tile", &q6_k_tile);
  m.impl("q6_k_tiles_matmul", &q6_k_tiles_matmul);
  m.impl("gguf_string_offsets", &gguf_string_offsets);
  m.impl("gguf_to_int4", &gguf_to_int4);
  m.impl("gguf_to_q8", &gguf_to_q8);
  m.impl("w8a8_quantize_rows", &w8a8_quantize_rows);
  m.impl("w8a8_scale_rows", &w8a8_scale_rows);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
  m.impl("lora_bgmv", &lora_bgmv);
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("is_packed_linear_weight", &is_packed_linear_weight);
  m.impl("dense_linear", &dense_linear);
}

TORCH_LIBRARY_IMPL(inferno, CompositeExplicitAutograd, m) {  // no tensor argument to dispatch on
  m.impl("drop_packed_linear_weight", &drop_packed_linear_weight);
}
