"""Quantized weights and the layers that compute with them (CPU inference).

- `linear.py`: `QuantizedLinear`, the one forward of every quantized linear layer (tiles, else the format's kernel
  below a row count, else a GEMM) and the tiling interface the worker's warm-up uses; `thresholds.py`: that row
  count per weight format and CPU instruction set.
- `groups.py`: weights as integer codes with a scale (and a min or zero point) per group of input columns, and the
  quantizers that make them from float weights.
- The formats: `int8.py` (per output channel, and group-wise with float32 activations: the default), `int4.py`
  (group-wise 4-bit: GGUF Q4_0 / Q4_1, AWQ / GPTQ), `q8.py` (signed int8 groups with int8 activations: GGUF Q8_0,
  Q5_0, Q5_1, Q5_K, Q6_K, and the LM heads), `q4_k.py` / `q6_k.py` (GGUF K-quant super-blocks as stored, their
  shared part in `super_blocks.py`), `w8a8.py` (int8 weights and activations, SmoothQuant factors from
  `activation_calibration.py`).
- `swap.py` swaps a float model's projections for quantized ones (quantization="int8" / "int4"); `native.py` loads
  a quantized checkpoint's own blocks into their layers (quantization="auto").
"""
