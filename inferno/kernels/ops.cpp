// The schemas of every `inferno::` operator, in one place: each kernel file registers only its CPU implementations
// (TORCH_LIBRARY_IMPL), and their shapes for torch.compile are in inferno/kernels/fake_ops.py. TORCH_LIBRARY, not a
// fragment: a second kernel library in the same process (another ISA level's) fails loudly at load instead of
// replacing the first one's implementations.
#include <torch/library.h>

TORCH_LIBRARY(inferno, m) {
  // paged_attention.cpp
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window=0) -> Tensor");

  // prefill_attention.cpp
  m.def("paged_prefill_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start, Tensor seq_lens, float scale, int window=0) -> Tensor");

  // quantized_gemv.cpp
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

  // q4_k_gemv.cpp
  m.def("q4_k_matmul(Tensor x, Tensor blocks) -> Tensor");
  m.def("q4_k_dequantize(Tensor blocks, ScalarType dtype) -> Tensor");
  m.def("q4_k_tile(Tensor blocks) -> Tensor");
  m.def("q4_k_tiles_matmul(Tensor x, Tensor tiles) -> Tensor");

  // q6_k_gemv.cpp
  m.def("q6_k_matmul(Tensor x, Tensor blocks) -> Tensor");
  m.def("q6_k_dequantize(Tensor blocks, ScalarType dtype) -> Tensor");
  m.def("q6_k_tile(Tensor blocks) -> Tensor");
  m.def("q6_k_tiles_matmul(Tensor x, Tensor tiles) -> Tensor");

  // gguf_repack.cpp
  m.def("gguf_string_offsets(Tensor bytes, int pos, int count) -> Tensor");
  m.def("gguf_to_int4(Tensor raw, int qtype, Tensor(a!) packed) -> ()");
  m.def("gguf_to_q8(Tensor raw, int qtype) -> (Tensor, Tensor, Tensor)");

  // w8a8_activations.cpp
  m.def("w8a8_quantize_rows(Tensor x, Tensor? input_scales, int rotation_block) -> (Tensor, Tensor)");
  m.def("w8a8_scale_rows(Tensor y, Tensor row_scales, Tensor? bias, Tensor(a!) out) -> ()");

  // fused_ops.cpp
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor x, Tensor rotations) -> Tensor");
}
