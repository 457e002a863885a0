"""Q8 groups (`Q8Groups`: signed int8 codes with a float32 scale, and optionally a min, per group of 16 or 32 input
columns; the GGUF Q8_0, Q5_0, Q5_1, Q5_K and Q6_K blocks hold exactly) times activations quantized to int8 per
block of 32, as llama.cpp computes: the native `inferno::int8_q8_matmul`. Also the LM head of the int4 and
per-channel int8 models (symmetric groups of 32, Q8_0)."""
import torch

from inferno.kernels import TILE_ROWS, quantized_gemv
from inferno.layers.quantization.groups import LM_HEAD_GROUP_SIZE, Q8Groups, quantize_q8_symmetric
from inferno.layers.quantization.linear import QuantizedLinear, float_rows


class Q8Linear(QuantizedLinear):
    """`Q8Groups` through the integer dot products of `inferno::int8_q8_matmul` below `gemm_from_rows` rows,
    dequantize-then-GEMM in `compute_dtype` from there or without the native kernels. Symmetric groups of 32 (Q8_0,
    Q5_0, the LM heads) can be regrouped into tiles of 16 rows (`tile`, every value kept;
    `inferno::q8_tiles_matmul`), which then run every batch size with the same integer sums; codes that fit 5 bits
    with float16 scales (Q5_0) into tiles of 5.5 bits per weight instead of 9 (`inferno::q5_tiles_matmul`: a decode
    step reads that much less)."""
    weight_format = "q8"
    tile_rows = TILE_ROWS
    unread_when_tiled = ("weight", "scales")
    five_bit_tiles = False  # `tile` made Q5 tiles

    def __init__(self, weight: Q8Groups, in_features: int, bias: torch.Tensor | None = None):
        """`weight` may have columns appended beyond `in_features` (up to a multiple of 32): inputs are zero-padded
        alike, so those columns add nothing."""
        if weight.group_size not in (16, 32) or weight.codes.shape[1] % 32:
            raise ValueError(f"Q8Linear takes groups of 16 or 32 and a multiple of 32 columns, got groups of "
                             f"{weight.group_size} and {weight.codes.shape[1]} columns")
        super().__init__(weight.codes.shape[0], in_features, bias, native=quantized_gemv() is not None,
                         padded_in_features=weight.codes.shape[1])
        self.group_size = weight.group_size
        self.register_buffer("weight", weight.codes.contiguous())
        self.register_buffer("scales", weight.scales.float().contiguous())
        self.register_buffer("mins", None if weight.mins is None else weight.mins.float().contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Q8Linear":
        """Symmetric groups of LM_HEAD_GROUP_SIZE (absmax / 127): the GGUF Q8_0 block, exact for it."""
        return cls(quantize_q8_symmetric(weight.detach(), LM_HEAD_GROUP_SIZE), weight.shape[1])

    @property
    def can_tile(self) -> bool:
        return super().can_tile and self.group_size == 32 and self.mins is None

    def make_tiles(self) -> torch.Tensor:
        self.five_bit_tiles = fits_five_bits(self.weight, self.scales)
        tile = torch.ops.inferno.q5_tile if self.five_bit_tiles else torch.ops.inferno.q8_tile
        return tile(self.weight, self.scales)

    def tiles_matmul(self, x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
        matmul = torch.ops.inferno.q5_tiles_matmul if self.five_bit_tiles else torch.ops.inferno.q8_tiles_matmul
        return matmul(float_rows(x), tiles)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.inferno.int8_q8_matmul(float_rows(x), self.weight, self.scales, self.mins,
                                                self.group_size)

    @property
    def q8_groups(self) -> Q8Groups:
        return Q8Groups(self.weight, self.scales, self.mins)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, padded K] in `dtype`, computed in float32 (codes * scales + mins) and rounded once."""
        if self.native and dtype in (torch.float32, torch.bfloat16):
            return torch.ops.inferno.int8_q8_dequantize(self.weight, self.scales, self.mins, self.group_size, dtype)
        return self.q8_groups.dequantize().to(dtype)


def fits_five_bits(codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """Codes in [-16, 15] and scales that are float16 values: the GGUF Q5_0 block, which the Q5 tiles hold exactly."""
    low, high = torch.aminmax(codes)
    return bool(low >= -16 and high <= 15 and torch.equal(scales.half().float(), scales))
