"""The native quantized kernels, whichever path this CPU builds (AVX-512 VNNI, AVX2 (+AVX-VNNI) or plain loops),
against float32/float64 PyTorch references: every row count of a decode step and more, output rows that fill no
whole thread chunk or row block, columns ending in a partial chunk, every group size, with and without mins,
extreme codes; the builds are keyed by the CPU."""

import pytest
import torch
import torch.nn.functional as F

from inferno.cpu_features import cpu_flags, cpu_key, has_native_bfloat16, isa_cflags
from inferno.kernels import quantized_gemv
from inferno.kernels.library import extension_name, kernels_disabled
from inferno.layers.quantization.groups import Q8Groups, ZeroPointInt4, quantize_int4, quantize_q8_symmetric
from inferno.layers.quantization.int4 import Int4Linear
from inferno.layers.quantization.q8 import Q8Linear
from inferno.layers.quantization.thresholds import GEMM_FROM_ROWS, compute_dtype, gemm_from_rows
from native_kernels import (EACH_ISA_LEVEL, isa_level_int4_tiles_outputs, isa_level_q8_tiles_outputs,
                            needs_kernels)

ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17]


def quantize_rows_like_q8(x: torch.Tensor) -> torch.Tensor:
    """x rounded the way the kernels quantize it: absmax / 127 per block of 32, to nearest (ties to even)."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.full_like(amax, 127) / amax  # a true division: PyTorch computes 127 / amax as 127 * (1 / amax)
    codes = torch.where(amax > 0, torch.round(blocks * inverse), 0)
    return (codes * (amax / 127)).view_as(x)


def random_q8_groups(n: int, k: int, group_size: int, with_mins: bool, seed: int) -> Q8Groups:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    codes[0, :32] = 127  # extreme codes: both ends of the range
    codes[-1, -32:] = -128
    scales = torch.rand(n, k // group_size, generator=g) / 50
    mins = -torch.rand(n, k // group_size, generator=g) / 5 if with_mins else None
    return Q8Groups(codes, scales, mins)


def assert_close_to(y: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    assert y.dtype == torch.float32 and y.shape == ref.shape
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=rtol * ref.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("group_size", [16, 32])
@pytest.mark.parametrize("with_mins", [False, True])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n, k", [(67, 96), (130, 1536)])  # N: no whole thread chunk / row block; K: 3 and 48 blocks
def test_q8_kernel_matches_float_sums_of_the_quantized_rows(m, n, k, group_size, with_mins):
    weight = random_q8_groups(n, k, group_size, with_mins, seed=m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[0, 32:64] = 0  # an all-zero block has scale 0
    x[-1, :32] = 3.0  # every activation code 127 against the extreme weight codes
    y = quantized_gemv().int8_q8_matmul(x, weight.codes, weight.scales, weight.mins, group_size)
    w = weight.dequantize().double()
    ref = quantize_rows_like_q8(x).double() @ w.t()  # the min terms too take the int8-rounded rows
    assert_close_to(y, ref)


@needs_kernels
def test_q8_kernel_rejects_bad_inputs():
    weight = random_q8_groups(16, 64, 32, with_mins=True, seed=0)
    kernel = quantized_gemv().int8_q8_matmul
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="group_size must be 16 or 32"):
        kernel(x, weight.codes, weight.scales, weight.mins, 64)
    with pytest.raises(RuntimeError, match="codes must be 2-D, int8"):
        kernel(x, weight.codes.view(torch.uint8), weight.scales, weight.mins, 32)
    with pytest.raises(RuntimeError, match="scales and mins must be float32"):
        kernel(x, weight.codes, weight.scales, weight.mins[:, :1].contiguous(), 32)
    with pytest.raises(RuntimeError, match="scales and mins must be float32"):
        kernel(x, weight.codes, weight.scales, None, 16)  # groups of 16 need 4 scales per row
    with pytest.raises(RuntimeError, match="x has 32 columns but codes have 64"):
        kernel(x[:, :32].contiguous(), weight.codes, weight.scales, None, 32)
    assert kernel(torch.randn(0, 64), weight.codes, weight.scales, None, 32).shape == (0, 16)


@needs_kernels
@pytest.mark.parametrize("group_size", [16, 32])
@pytest.mark.parametrize("with_mins", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_dequantizer_computes_codes_times_scales_plus_mins_in_float32(group_size, with_mins, dtype):
    weight = random_q8_groups(70, 640, group_size, with_mins, seed=group_size)
    w = quantized_gemv().int8_q8_dequantize(weight.codes, weight.scales, weight.mins, group_size, dtype)
    assert w.dtype == dtype and torch.equal(w, weight.dequantize().to(dtype))


def int4_reference(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """The int8-rounded rows times the weights, in float64 (the min terms too take the rounded rows)."""
    return quantize_rows_like_q8(x).double() @ layer.dequantize().double().t()


@needs_kernels
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("k, group_size", [
    (160, 32),  # 5 blocks: one partial chunk, one partial half
    (544, 32),  # 17 blocks: a last half chunk of 1
    (576, 32),  # 18 blocks (SmolLM2's hidden size): a last half chunk of 2
    (608, 32),  # 19 blocks: a chunk of 16 and one of 3
    (864, 32),  # 27 blocks: a chunk of 16 and one of 11 (a whole half and a partial one)
    (704, 64),  # 22 blocks: a last chunk of 6
    (896, 128),  # 28 blocks: a last chunk of 12
    (1536, 64),  # whole chunks only
])
def test_int4_kernel_matches_the_sums_it_promises(m, k, group_size):
    n = 37  # no whole thread chunk of 16
    torch.manual_seed(m * k + group_size)
    weight = quantize_int4(torch.randn(n, k), group_size)
    weight.codes[0] = 15  # extreme codes against extreme activations
    weight.codes[1] = 0
    layer = Int4Linear(weight, None)
    x = torch.randn(m, k)
    x[0, 32:64] = 0  # an all-zero block has scale 0
    x[-1] = 2.0  # every activation code 127: the 16-bit sums of the AVX2 kernel at their largest
    y = quantized_gemv().int4_q8_matmul(x, layer.weight, group_size)
    assert_close_to(y, int4_reference(layer, x))


def int4_layer(n: int, k: int, group_size: int, zero_points: bool, seed: int) -> Int4Linear:
    """Random int4 weights (with integer zero points: the AWQ / GPTQ form) whose row 0 is all codes 15 and row 1
    all 0."""
    g = torch.Generator().manual_seed(seed)
    weight = quantize_int4(torch.randn(n, k, generator=g), group_size)
    weight.codes[0], weight.codes[1] = 15, 0
    if zero_points:
        zeros = torch.randint(0, 17, weight.scales.shape, dtype=torch.uint8, generator=g)
        weight = ZeroPointInt4(weight.codes, weight.scales.half(), zeros=zeros)
    return Int4Linear(weight, None)


def int4_kernel_inputs(m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k))
    x[0, 32:64] = 0  # an all-zero block has scale 0
    x[-1, :64] = 2.0  # activation codes 127 and -127 against whole rows of codes 15: the 16-bit sums at their largest
    x[-1, 64:128] = -2.0
    return x


def untiled_int4(tiles: torch.Tensor, k: int, zero_points: bool) -> torch.Tensor:
    """The weight [N, K] rebuilt from int4 tiles as the layout promises (quantized_gemv.cpp), in float32 as the
    dequantizer computes it: code * d + min, min = -zero * d with zero points."""
    blocks = tiles.view(tiles.shape[0], k // 32, 320)
    d = blocks[..., :32].contiguous().view(torch.float16).float()  # [tiles, blocks, 16 rows]
    second = blocks[..., 32:64].contiguous().view(torch.float16).float()
    lanes = blocks[..., 64:].reshape(tiles.shape[0], k // 32, 4, 16, 4)  # (tile, block, group, row, column)
    codes = torch.cat([lanes & 0x0F, lanes >> 4], dim=-1)  # columns 8 g + c and 8 g + 4 + c
    codes = codes.permute(0, 3, 1, 2, 4).reshape(tiles.shape[0] * 16, k // 32, 32).float()
    d, second = (t.permute(0, 2, 1).reshape(-1, k // 32, 1) for t in (d, second))
    min = -second * d if zero_points else second
    return (codes * d + min).view(-1, k)


@needs_kernels
@pytest.mark.parametrize("k, group_size", [(576, 32), (704, 64), (896, 128)])
@pytest.mark.parametrize("zero_points", [False, True])
def test_int4_tiles_hold_every_value(k, group_size, zero_points):
    layer = int4_layer(48, k, group_size, zero_points, seed=k)
    layer.tile()
    assert layer.tiles.shape == (3, k // 32 * 320) and layer.unread_buffers == ("weight",)
    assert torch.equal(untiled_int4(layer.tiles, k, zero_points), layer.dequantize())


@needs_kernels
@pytest.mark.parametrize("m", [*ROWS, 130])  # 130: two panels of rows (128 each)
@pytest.mark.parametrize("k, group_size", [(32, 32), (576, 32), (704, 64), (1536, 128)])
@pytest.mark.parametrize("zero_points", [False, True])
def test_int4_tiles_kernel_matches_the_sums_it_promises(m, k, group_size, zero_points):
    layer = int4_layer(80, k, group_size, zero_points, seed=m)  # 5 tiles: a group of 4 and one more
    x = int4_kernel_inputs(m, k)
    tiles = quantized_gemv().int4_tile(layer.weight, k, group_size)
    assert_close_to(quantized_gemv().int4_tiles_matmul(x, tiles, zero_points), int4_reference(layer, x))


@needs_kernels
@EACH_ISA_LEVEL
def test_each_isa_level_of_the_int4_tiles_kernel_computes_the_same_sums(tmp_path, level):
    layer = int4_layer(48, 704, 64, zero_points=True, seed=0)
    xs = [int4_kernel_inputs(m, 704) for m in (1, 5)]
    ys = isa_level_int4_tiles_outputs(tmp_path, level, xs, layer.weight, 704, 64, True)
    for x, y in zip(xs, ys):
        assert_close_to(y, int4_reference(layer, x))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 6, gemm_from_rows("int4") + 1])
def test_tiled_int4_linear_computes_the_kernels_sums_at_every_batch_size(rows):
    weight = quantize_int4(torch.randn(208, 600, generator=torch.Generator().manual_seed(rows)), 32)
    layer = Int4Linear(weight, bias=torch.randn(208), in_features=600)  # 8 appended columns, ignored
    x = torch.randn(2, rows, 600, generator=torch.Generator().manual_seed(rows))
    untiled = layer(x)
    assert layer.can_tile and layer.unread_buffers == ()
    layer.tile()
    y = layer(x)
    assert y.shape == (2, rows, 208) and layer.tiles is not None
    ref = quantize_rows_like_q8(F.pad(x.reshape(-1, 600), (0, 8))).double() @ layer.dequantize().double().t()
    assert_close_to(y.reshape(-1, 208) - layer.bias, ref)
    if rows < layer.gemm_from_rows:  # the same integer sums as the packed rows' kernel
        torch.testing.assert_close(y, untiled, rtol=1e-5, atol=1e-5 * untiled.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("k", [576, 9216])  # 9216: past L1 for a whole row block of x, so the kernel chunks K
def test_tiles_give_a_row_the_same_bits_in_any_batch(k):
    """A row's output does not depend on the other rows beside it, nor on their number (which decides how the rows
    are blocked, and nothing else)."""
    gen = torch.Generator().manual_seed(k)
    layer = Int4Linear(quantize_int4(torch.randn(32, k, generator=gen), 32), None)
    layer.tile()
    x = torch.randn(11, k, generator=gen)
    batched = layer(x)
    for m in (1, 2, 3, 5, 9):
        assert torch.equal(layer(x[:m]), batched[:m]), f"{m} rows"
    assert all(torch.equal(layer(x[r:r + 1])[0], batched[r]) for r in range(len(x)))


@needs_kernels
def test_int4_tiles_give_a_row_the_same_bits_in_batches_of_many_row_blocks_and_panels():
    """Prompt-sized batches (several row blocks and panels of 128 rows, a short last block, a row at any offset in
    its block) give a row the bits it gets alone."""
    gen = torch.Generator().manual_seed(2048)
    layer = Int4Linear(quantize_int4(torch.randn(48, 576, generator=gen), 32), None)
    layer.tile()
    x = torch.randn(2048, 576, generator=gen)
    batched = layer(x)
    for start, m in ((0, 7), (0, 64), (0, 300), (5, 300), (1, 2047)):
        assert torch.equal(layer(x[start:start + m]), batched[start:start + m]), f"rows {start}..{start + m - 1}"
    assert all(torch.equal(layer(x[r:r + 1])[0], batched[r]) for r in (0, 6, 63, 127, 128, 299, 2047))


def test_an_int4_weight_of_rows_not_a_multiple_of_16_is_not_tiled():
    layer = Int4Linear(quantize_int4(torch.randn(200, 64), 32), None)
    layer.tile()
    assert not layer.can_tile and layer.tiles is None


@needs_kernels
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_dequantizer_matches_torch(group_size, dtype):
    layer = Int4Linear(quantize_int4(torch.randn(70, 640), group_size), None)
    native = layer.dequantize(dtype)
    layer.native = False
    assert native.dtype == dtype and torch.equal(native, layer.dequantize(dtype))


def untiled_q8(tiles: torch.Tensor, k: int) -> torch.Tensor:
    """The weight [N, K] rebuilt from Q8 tiles as the layout promises (quantized_gemv.cpp): code * d in float32."""
    blocks = tiles.view(tiles.shape[0], k // 32, 576)
    d = blocks[..., :64].contiguous().view(torch.float32)  # [tiles, blocks, 16 rows]
    lanes = blocks[..., 64:].reshape(tiles.shape[0], k // 32, 8, 16, 4)  # (tile, block, group, row, column)
    codes = (lanes.to(torch.int16) - 128).permute(0, 3, 1, 2, 4).reshape(tiles.shape[0] * 16, k // 32, 32).float()
    return (codes * d.permute(0, 2, 1).reshape(-1, k // 32, 1)).view(-1, k)


def q8_kernel_inputs(m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
    x[0, :32] = 0  # an all-zero block has scale 0
    x[-1, -32:] = 3.0  # every activation code 127 against the extreme weight codes
    return x


@needs_kernels
@pytest.mark.parametrize("k", [32, 576, 1536])
def test_q8_tiles_hold_every_value(k):
    layer = Q8Linear(random_q8_groups(48, k, 32, with_mins=False, seed=k), k)
    assert layer.can_tile and layer.unread_buffers == ()
    layer.tile()
    assert layer.tiles.shape == (3, k // 32 * 576) and layer.unread_buffers == ("weight", "scales")
    assert torch.equal(untiled_q8(layer.tiles, k), layer.dequantize())


@needs_kernels
@pytest.mark.parametrize("rows", [1, 6, gemm_from_rows("q8") + 1])
def test_tiled_q8_linear_computes_the_kernels_sums_at_every_batch_size(rows):
    layer = Q8Linear(random_q8_groups(208, 128, 32, with_mins=False, seed=rows), in_features=100,
                     bias=torch.randn(208))  # 28 appended columns, ignored
    x = torch.randn(2, rows, 100, generator=torch.Generator().manual_seed(rows))
    untiled = layer(x)
    layer.tile()
    y = layer(x)
    assert y.shape == (2, rows, 208) and layer.tiles is not None
    ref = quantize_rows_like_q8(F.pad(x.reshape(-1, 100), (0, 28))).double() @ layer.dequantize().double().t()
    assert_close_to(y.reshape(-1, 208) - layer.bias, ref)
    if rows < layer.gemm_from_rows:  # the same integer sums as the untiled kernel
        torch.testing.assert_close(y, untiled, rtol=1e-5, atol=1e-5 * untiled.abs().max().item())


def random_q5_groups(n: int, k: int, seed: int) -> Q8Groups:
    """The GGUF Q5_0 block as Q8Groups: codes q - 16 in [-16, 15] (both ends included) and float16 scales."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-16, 16, (n, k), dtype=torch.int8, generator=g)
    codes[0, :32] = 15
    codes[-1, -32:] = -16
    return Q8Groups(codes, (torch.rand(n, k // 32, generator=g) / 50).half().float())


def untiled_q5(tiles: torch.Tensor, k: int) -> torch.Tensor:
    """The weight [N, K] rebuilt from Q5 tiles as the layout promises (q5_tiles.cpp): (q - 16) * d in float32."""
    t, b = tiles.shape[0], k // 32
    blocks = tiles.view(t, b, 352)
    d = blocks[..., :32].contiguous().view(torch.float16).float()  # [tiles, blocks, 16 rows]
    bits = blocks[..., 32:96].reshape(t, b, 4, 2, 8, 1) >> torch.arange(8, dtype=torch.uint8) & 1
    fifth = bits.reshape(t, b, 4, 2, 64)  # (tile, block, group, low / high nibbles, lane 4 r + c)
    nibbles = blocks[..., 96:].reshape(t, b, 4, 1, 64) >> torch.tensor([[0], [4]], dtype=torch.uint8) & 0x0F
    q = (nibbles | fifth << 4).reshape(t, b, 4, 2, 16, 4)  # (tile, block, group, half, row, column)
    codes = q.permute(0, 4, 1, 2, 3, 5).reshape(t * 16, b, 32).float() - 16  # column 8 group + 4 half + c
    return (codes * d.permute(0, 2, 1).reshape(-1, b, 1)).view(-1, k)


@needs_kernels
@pytest.mark.parametrize("k", [32, 576, 896])
def test_q5_tiles_hold_every_value(k):
    layer = Q8Linear(random_q5_groups(48, k, seed=k), k)
    layer.tile()
    assert layer.five_bit_tiles and layer.tiles.shape == (3, k // 32 * 352)
    assert layer.unread_buffers == ("weight", "scales")
    assert torch.equal(untiled_q5(layer.tiles, k), layer.dequantize())


# symmetric groups of 32 per kind of their tiles: Q8's (any int8 codes), Q5's (the Q5_0 block)
TILED_GROUPS = {"q8": lambda n, k, seed: random_q8_groups(n, k, 32, with_mins=False, seed=seed),
                "q5": random_q5_groups}


@needs_kernels
@pytest.mark.parametrize("m", [*ROWS, 130])  # 130: two panels of rows (128 each)
@pytest.mark.parametrize("k", [32, 576, 1536])
@pytest.mark.parametrize("tiles", list(TILED_GROUPS))
def test_q8_and_q5_tiles_kernels_match_float_sums_of_the_quantized_rows(tiles, m, k):
    weight = TILED_GROUPS[tiles](80, k, seed=m)  # 5 tiles: a group of 4 and one more
    x, ops = q8_kernel_inputs(m, k), quantized_gemv()
    y = getattr(ops, f"{tiles}_tiles_matmul")(x, getattr(ops, f"{tiles}_tile")(weight.codes, weight.scales))
    assert_close_to(y, quantize_rows_like_q8(x).double() @ weight.dequantize().double().t())


@needs_kernels
@EACH_ISA_LEVEL
@pytest.mark.parametrize("tiles", list(TILED_GROUPS))
def test_each_isa_level_of_the_q8_and_q5_tiles_kernels_computes_the_same_sums(tmp_path, tiles, level):
    weight = TILED_GROUPS[tiles](48, 576, seed=0)
    xs = [q8_kernel_inputs(m, 576) for m in (1, 5)]
    ys = isa_level_q8_tiles_outputs(tmp_path, level, xs, weight.codes, weight.scales, tiles)
    for x, y in zip(xs, ys):
        assert_close_to(y, quantize_rows_like_q8(x).double() @ weight.dequantize().double().t())


@needs_kernels
@pytest.mark.parametrize("beyond", ["code 16", "code -17", "scale not a float16"])
def test_q8_linear_makes_q5_tiles_only_of_what_they_hold_exactly(beyond):
    weight = random_q5_groups(32, 64, seed=1)
    if beyond == "code 16":
        weight.codes[3, 7] = 16
    elif beyond == "code -17":
        weight.codes[31, 63] = -17
    else:
        weight.scales[5, 1] += 1e-7
    layer = Q8Linear(weight, 64)
    layer.tile()
    assert not layer.five_bit_tiles and layer.tiles.shape == (2, 2 * 576)
    assert torch.equal(untiled_q8(layer.tiles, 64), layer.dequantize())
    with pytest.raises(RuntimeError, match=r"codes in \[-16, 15\] and float16 scales"):
        quantized_gemv().q5_tile(weight.codes, weight.scales)


@pytest.mark.parametrize("n, group_size, with_mins", [(64, 32, True), (64, 16, False), (200, 32, False)])
def test_q8_linear_tiles_only_symmetric_groups_of_32_and_whole_tiles(n, group_size, with_mins):
    layer = Q8Linear(random_q8_groups(n, 64, group_size, with_mins, seed=0), 64)
    layer.tile()
    assert not layer.can_tile and layer.tiles is None


@pytest.mark.parametrize("rows", [1, 6, gemm_from_rows("q8") + 1])  # the last: dense GEMM
@pytest.mark.parametrize("group_size, with_mins", [(32, False), (16, False), (32, True), (16, True)])
@pytest.mark.parametrize("native", [True, False])
def test_q8_linear_matches_its_dequantized_weight(rows, group_size, with_mins, native):
    weight = random_q8_groups(200, 128, group_size, with_mins, seed=rows)
    layer = Q8Linear(weight, in_features=100, bias=torch.randn(200))  # 28 appended columns, ignored
    if not native:
        layer.native = False
    elif kernels_disabled():
        pytest.skip("INFERNO_DISABLE_CPP_KERNELS=1")
    else:
        assert layer.native
    x = torch.randn(2, rows, 100)
    ref = x @ weight.dequantize()[:, :100].t() + layer.bias
    y = layer(x)
    assert y.shape == (2, rows, 200) and y.dtype == torch.float32
    assert ((y - ref).norm() / ref.norm()).item() < 1e-2  # int8-quantized activations (or the GEMM in compute_dtype)


def test_q8_linear_from_float_holds_symmetric_groups_of_32():
    w = torch.randn(64, 96)
    layer = Q8Linear.from_float(w)
    q = quantize_q8_symmetric(w, 32)
    assert layer.weight.dtype == torch.int8 and layer.mins is None and layer.group_size == 32
    assert torch.equal(layer.dequantize(), q.codes.float() * q.scales.repeat_interleave(32, dim=1))
    assert ((layer.dequantize() - w).abs() <= q.scales.repeat_interleave(32, dim=1) / 2 + 1e-7).all()


def test_q8_linear_rejects_groups_it_cannot_run():
    with pytest.raises(ValueError, match="groups of 16 or 32"):
        Q8Linear(random_q8_groups(8, 128, 64, False, seed=0), 128)


def test_q8_groups_cat_fills_missing_mins_with_zeros():
    a, b = random_q8_groups(4, 64, 32, True, seed=1), random_q8_groups(3, 64, 32, False, seed=2)
    both = Q8Groups.cat([a, b])
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_zero_point_groups_stack_with_their_zero_points_and_take_them_by_name():
    codes = torch.randint(0, 16, (6, 64), dtype=torch.uint8)
    a = ZeroPointInt4(codes, torch.rand(6, 2).half(), zeros=torch.randint(0, 17, (6, 2), dtype=torch.uint8))
    b = a.map_rows(lambda t: t[[5, 0, 3]])
    assert torch.equal(ZeroPointInt4.cat([a, b]).dequantize(), torch.cat([a.dequantize(), a.dequantize()[[5, 0, 3]]]))
    with pytest.raises(ValueError, match="zeros="):
        ZeroPointInt4(a.codes, a.scales, a.zeros)  # the third field is the mins


def test_compute_dtype_is_bfloat16_only_with_native_bfloat16_gemms():
    assert compute_dtype() == (torch.bfloat16 if has_native_bfloat16() else torch.float32)


def test_a_layer_takes_the_thresholds_of_the_instruction_set_it_is_made_under(monkeypatch):
    monkeypatch.setattr("inferno.cpu_features.cpu_info",
                        lambda: {"flags": "avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16"})
    wide = Int4Linear(quantize_int4(torch.randn(32, 64), 32), None)
    monkeypatch.setenv("INFERNO_CPU_ISA", "avx2")
    capped = Int4Linear(quantize_int4(torch.randn(32, 64), 32), None)
    assert (wide.gemm_from_rows, capped.gemm_from_rows) == GEMM_FROM_ROWS["int4"] == (96, 512)
    assert (wide.compute_dtype, capped.compute_dtype) == (torch.bfloat16, torch.float32)


def test_builds_are_keyed_by_the_cpu():
    info = {"model name": "AMD EPYC", "flags": "fpu sse2 avx avx2 fma"}
    assert cpu_key(info) == cpu_key({**info, "flags": "avx2 fma fpu sse2 avx"})  # order does not matter
    assert cpu_key(info) != cpu_key({**info, "flags": info["flags"] + " avx512f"})
    assert cpu_key(info) != cpu_key({**info, "model name": "Intel Xeon"})
    name = extension_name("inferno_quantized_gemv", ("quantized_gemv.cpp",), ["-O3"])
    assert len(cpu_key()) == 8 and name.startswith(f"inferno_quantized_gemv_{cpu_key()}_")
    # what the build compiles is in the name too: another flag, another source
    assert extension_name("inferno_quantized_gemv", ("quantized_gemv.cpp",), ["-O2"]) != name
    assert extension_name("inferno_quantized_gemv", ("q4_k_gemv.cpp",), ["-O3"]) != name


def test_an_isa_cap_leaves_the_wider_flags_out_and_builds_without_them(monkeypatch):
    monkeypatch.setattr("inferno.cpu_features.cpu_info",
                        lambda: {"flags": "avx avx2 fma avx_vnni avx512f avx512bw avx512_vnni avx512_bf16 amx_tile"})
    monkeypatch.setenv("INFERNO_CPU_ISA", "avx2")
    assert cpu_flags() == {"avx", "avx2", "fma"} and "-mno-avx512f" in isa_cflags()
    assert not has_native_bfloat16()
    monkeypatch.setenv("INFERNO_CPU_ISA", "avx2_vnni")
    assert cpu_flags() == {"avx", "avx2", "fma", "avx_vnni"} and "-mno-avxvnni" not in isa_cflags()
    monkeypatch.setenv("INFERNO_CPU_ISA", "avx512")
    assert cpu_flags() == {"avx", "avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}
    monkeypatch.setenv("INFERNO_CPU_ISA", "scalar")
    assert cpu_flags() == set() and {"-mno-avx", "-mno-fma"} <= set(isa_cflags())
    monkeypatch.setenv("INFERNO_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="INFERNO_CPU_ISA must be one of"):
        cpu_flags()
    monkeypatch.delenv("INFERNO_CPU_ISA")
    assert "avx512f" in cpu_flags() and isa_cflags() == []
