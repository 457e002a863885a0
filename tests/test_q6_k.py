"""GGUF Q6_K run as stored (layers/quantization/q6_k.py, kernels/q6_k_gemv.cpp): the super-blocks hold the file's
weights bit for bit, the kernel computes the float sums of the int8-rounded rows on every path this CPU can run (the
-march=native build, and builds without AVX-512 and without AVX2), and the layer matches its dequantized weight
for decode-sized and large batches."""
import gguf
import numpy as np
import pytest
import torch

from inferno.kernels.library import kernels_disabled
from inferno.layers.quantization.thresholds import gemm_from_rows
from inferno.layers.quantization.q6_k import Q6KBlocks, Q6KEmbedding, Q6KLinear
from native_kernels import EACH_ISA_LEVEL, isa_level_outputs, isa_level_tiles_outputs, needs_kernels
from test_kernels import assert_close_to, quantize_rows_like_q8
from tiny_gguf import T, random_blocks

# float16 d at the ends of its range (largest, smallest subnormal, negative, zero) and ordinary ones
EXTREME_D = np.array([65504, -65504, 6e-8, -6e-8, 0, 1e-4, -0.5, 2.0], dtype=np.float16)


def random_q6_k(n: int, k: int, seed: int, extreme: bool = False) -> np.ndarray:
    """Valid Q6_K rows [n, k / 256 * 210]: random codes and int8 scales (every byte pattern is data) with small d;
    `extreme`: every scale -128 or 127 in the first row, d from EXTREME_D, all codes 0 or 63 in two rows."""
    raw = random_blocks(T.Q6_K, n, k, np.random.default_rng(seed))
    if extreme:
        blocks = raw.reshape(n, -1, 210)
        blocks[0, :, 192:208] = np.array([128, 127] * 8, dtype=np.uint8)  # int8 -128, 127
        d = EXTREME_D[np.arange(blocks.shape[0] * blocks.shape[1]) % len(EXTREME_D)]
        blocks[..., 208:210] = d.view(np.uint8).reshape(n, -1, 2)
        blocks[1, :, :192] = 0  # q = 0: w = -32 d sc
        blocks[2, :, :192] = 0xFF  # q = 63: w = 31 d sc
    return raw


@pytest.mark.parametrize("native", [True, False], ids=["native", "pytorch"])
@pytest.mark.parametrize("extreme", [False, True], ids=["random", "extreme"])
def test_blocks_dequantize_bit_exactly_like_gguf(native, extreme):
    if native and kernels_disabled():
        pytest.skip("INFERNO_DISABLE_CPP_KERNELS=1")
    raw = random_q6_k(9, 1792, seed=extreme, extreme=extreme)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, T.Q6_K))
    blocks = Q6KBlocks(torch.from_numpy(raw))
    assert blocks.shape == (9, 1792)
    assert torch.equal(blocks.dequantize(native=native), expected)
    assert torch.equal(blocks.dequantize(torch.bfloat16, native=native), expected.bfloat16())
    assert torch.equal(blocks.q8_groups().dequantize(), expected)


def kernel_reference(x: torch.Tensor, raw: np.ndarray) -> torch.Tensor:
    """The sums the kernel promises: the int8-rounded rows times the exact weights, in float64."""
    w = torch.from_numpy(gguf.quants.dequantize(raw, T.Q6_K)).double()
    return quantize_rows_like_q8(x).double() @ w.t()


def kernel_inputs(m: int, n: int, k: int) -> tuple[torch.Tensor, np.ndarray]:
    raw = random_q6_k(n, k, seed=m * k + n, extreme=True)
    blocks = raw.reshape(n, -1, 210)
    blocks[..., 208:210] = np.float16(2e-4).reshape(1).view(np.uint8)  # extreme codes and scales, ordinary d
    blocks[0, 0, :192] = 0xFF  # weight row 0 starts with a whole super-block of codes 63: the largest sums
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[0, 32:64] = 0  # an all-zero block has scale 0
    x[-1, :64] = 3.0  # activation codes 127 against codes 0 / 63 and scales -128 / 127
    x[-1, 64:96] = -3.0  # and -127
    return x, raw


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("k", [256, 512, 1792, 8960])  # 1, 2, 7 super-blocks; Qwen2.5-1.5B's ffn_down
def test_kernel_matches_float_sums_of_the_quantized_rows(m, k):
    x, raw = kernel_inputs(m, 37, k)  # 37 output rows: no whole thread chunk of 16
    y = torch.ops.inferno.q6_k_matmul(x, torch.from_numpy(raw))
    assert_close_to(y, kernel_reference(x, raw))


@needs_kernels
@EACH_ISA_LEVEL
def test_each_isa_level_computes_the_same_sums(tmp_path, level):
    """The AVX2 path and the plain loops, built on this CPU without the instructions they must not use (the first
    build takes about half a minute; later runs reuse it)."""
    xs_raws = [kernel_inputs(m, 37, 1792) for m in (1, 3, 5)]
    raw = xs_raws[0][1]
    xs = [x for x, _ in xs_raws]
    ys, w = isa_level_outputs(tmp_path, "q6_k", level, xs, torch.from_numpy(raw))
    assert torch.equal(w, torch.from_numpy(gguf.quants.dequantize(raw, T.Q6_K)))
    for x, y in zip(xs, ys):
        assert_close_to(y, kernel_reference(x, raw))


@pytest.mark.parametrize("rows", [1, 6, gemm_from_rows("q6_k") + 1])  # the last: dense GEMM
@pytest.mark.parametrize("native", [True, False], ids=["native", "pytorch"])
def test_linear_matches_its_dequantized_weight(rows, native):
    raw = random_q6_k(200, 512, seed=rows)
    layer = Q6KLinear(Q6KBlocks(torch.from_numpy(raw)), bias=torch.randn(200))
    if not native:
        layer.native = False
    elif kernels_disabled():
        pytest.skip("INFERNO_DISABLE_CPP_KERNELS=1")
    else:
        assert layer.native
    assert (layer.in_features, layer.out_features) == (512, 200)
    x = torch.randn(2, rows, 512, generator=torch.Generator().manual_seed(rows))
    ref = x @ torch.from_numpy(gguf.quants.dequantize(raw, T.Q6_K)).t() + layer.bias
    y = layer(x)
    assert y.shape == (2, rows, 200) and y.dtype == torch.float32
    assert ((y - ref).norm() / ref.norm()).item() < 3e-2  # int8-quantized activations (or the GEMM in compute_dtype)


def test_embedding_dequantizes_the_rows_it_reads_and_shares_them_with_a_tied_head():
    raw = random_q6_k(50, 256, seed=3)
    embedding = Q6KEmbedding(Q6KBlocks(torch.from_numpy(raw)), torch.float32)
    ids = torch.tensor([[4, 0, 49], [4, 7, 7]])
    w = torch.from_numpy(gguf.quants.dequantize(raw, T.Q6_K))
    assert torch.equal(embedding(ids), w[ids])
    head = embedding.as_lm_head()
    assert head.weight.data_ptr() == embedding.blocks.data_ptr() and head.out_features == 50


def test_rows_permute_and_stack_like_the_weights():
    a, b = random_q6_k(8, 512, seed=1), random_q6_k(5, 512, seed=2)
    order = torch.tensor([3, 0, 7, 1, 6, 2, 5, 4])
    both = Q6KBlocks.cat([Q6KBlocks(torch.from_numpy(a)).map_rows(lambda t: t[order]), Q6KBlocks(torch.from_numpy(b))])
    expected = np.concatenate([gguf.quants.dequantize(a, T.Q6_K)[order.numpy()], gguf.quants.dequantize(b, T.Q6_K)])
    assert both.shape == (13, 512) and np.array_equal(both.dequantize().numpy(), expected)


@needs_kernels
def test_kernel_rejects_bad_inputs():
    blocks = torch.from_numpy(random_q6_k(4, 512, seed=0))
    with pytest.raises(RuntimeError, match="x has 256 columns but the blocks hold 512"):
        torch.ops.inferno.q6_k_matmul(torch.randn(2, 256), blocks)
    with pytest.raises(RuntimeError, match="Q6_K super-blocks"):
        torch.ops.inferno.q6_k_matmul(torch.randn(2, 512), blocks[:, :400].contiguous())
    with pytest.raises(RuntimeError, match="x must be 2-D, float32"):
        torch.ops.inferno.q6_k_matmul(torch.randn(2, 512).double(), blocks)
    assert torch.ops.inferno.q6_k_matmul(torch.randn(0, 512), blocks).shape == (0, 4)


def untile(tiles: np.ndarray, n: int, k: int) -> np.ndarray:
    """Q6_K weights [n, k] rebuilt from q6_k_tile's layout (the kernel file's description), d * sc * (q - 32), to
    check that the tiles keep every value of the stored blocks."""
    supers = k // 256
    t = tiles.reshape(n // 16, supers, 3360)
    d = t[..., 0:32].view(np.float16).astype(np.float32)  # [tiles, supers, 16]
    sc = t[..., 32:288].view(np.int8).reshape(-1, supers, 16, 16).astype(np.float32)  # [.., group, row]
    low = t[..., 288:2336].reshape(-1, supers, 32, 16, 4)  # [.., group of 8, row, c]
    low = np.concatenate([low & 0x0F, low >> 4], axis=-1)  # columns 8 G + c, c < 8
    high = t[..., 2336:].reshape(-1, supers, 16, 1, 16, 4)  # [.., group of 16, v, row, c]
    high = (high >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1, 1)) & 3
    low = low.transpose(0, 1, 3, 2, 4).reshape(-1, supers, 16, 256)  # [.., row, column]
    high = high.transpose(0, 1, 4, 2, 3, 5).reshape(-1, supers, 16, 256)
    q = (low | high << 4).astype(np.float32) - 32
    w = d[..., :, None] * sc.transpose(0, 1, 3, 2).repeat(16, axis=-1) * q  # [tiles, supers, row, column]
    return w.transpose(0, 2, 1, 3).reshape(n, k)


@needs_kernels
@pytest.mark.parametrize("extreme", [False, True], ids=["random", "extreme"])
def test_tiles_keep_every_value_of_the_stored_blocks(extreme):
    raw = random_q6_k(32, 1792, seed=extreme, extreme=extreme)
    tiles = torch.ops.inferno.q6_k_tile(torch.from_numpy(raw)).numpy()
    assert tiles.shape == (2, 7 * 3360)
    expected = gguf.quants.dequantize(raw, T.Q6_K)  # (d * sc) * (q - 32) in float32: bit for bit
    assert np.array_equal(untile(tiles, 32, 1792), expected, equal_nan=True)


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 8, 9, 40, 130])  # 130: two panels of rows (128 each)
@pytest.mark.parametrize("k", [256, 1792, 8960])
def test_tiles_kernel_matches_float_sums_of_the_quantized_rows(m, k):
    x, raw = kernel_inputs(m, 80, k)  # 5 tiles: a group of 4 and one more, split between threads
    tiles = torch.ops.inferno.q6_k_tile(torch.from_numpy(raw))
    assert_close_to(torch.ops.inferno.q6_k_tiles_matmul(x, tiles), kernel_reference(x, raw))


@needs_kernels
@EACH_ISA_LEVEL
def test_each_isa_level_of_the_tiles_kernel_computes_the_same_sums(tmp_path, level):
    xs_raws = [kernel_inputs(m, 48, 1792) for m in (1, 5)]
    raw = xs_raws[0][1]
    xs = [x for x, _ in xs_raws]
    ys = isa_level_tiles_outputs(tmp_path, "q6_k", level, xs, torch.from_numpy(raw))
    for x, y in zip(xs, ys):
        assert_close_to(y, kernel_reference(x, raw))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 6, gemm_from_rows("q6_k") + 1])
def test_tiled_linear_matches_its_dequantized_weight_at_every_batch_size(rows):
    raw = random_q6_k(208, 512, seed=rows)
    layer = Q6KLinear(Q6KBlocks(torch.from_numpy(raw)), bias=torch.randn(208))
    x = torch.randn(2, rows, 512, generator=torch.Generator().manual_seed(rows))
    untiled = layer(x)
    layer.tile()
    assert layer.tiles is not None and layer.unread_buffers == ("weight",)
    ref = x @ torch.from_numpy(gguf.quants.dequantize(raw, T.Q6_K)).t() + layer.bias
    y = layer(x)
    assert y.shape == (2, rows, 208)
    assert ((y - ref).norm() / ref.norm()).item() < 3e-2  # int8-quantized activations: 0.5 % typical, 1.5 % the worst of 1000 draws
    if rows < layer.gemm_from_rows:  # the same integer sums as the kernel on the stored blocks
        torch.testing.assert_close(y, untiled, rtol=1e-5, atol=1e-5 * untiled.abs().max().item())
