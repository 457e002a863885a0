"""GGUF Q4_K run as stored (layers/quantization/q4_k.py, kernels/q4_k_gemv.cpp): the super-blocks hold the file's
weights bit for bit (no repack at load), the kernel computes the float sums of the int8-rounded rows on every path
this CPU can run (the -march=native build, and builds without AVX-512 and without AVX2), and the layer matches its
dequantized weight for decode-sized and large batches. The tiles the engine regroups the blocks into keep every
value, their kernel computes the same sums on every path, and an engine switches to them between its first step and
its second."""

import gguf
import numpy as np
import pytest
import torch

from inferno import LLM, SamplingParams
from inferno.kernels.library import kernels_disabled
from inferno.layers.quantization.thresholds import gemm_from_rows
from inferno.layers.quantization.q4_k import Q4KBlocks, Q4KLinear
from inferno.layers.quantization.int4 import Int4Linear
from inferno.layers.quantization.super_blocks import SuperBlockLinear
from inferno.loader.gguf_file import GGUFFile
from inferno.loader.model_loader import load_model
from inferno.worker.huge_pages import tensor_span, weight_ranges
from native_kernels import EACH_ISA_LEVEL, isa_level_outputs, isa_level_tiles_outputs, needs_kernels
from test_kernels import assert_close_to, quantize_rows_like_q8
from tiny_gguf import T, random_blocks, write_tiny_gguf

# float16 d / dmin at the ends of their range (largest, smallest subnormal, negative, zero) and ordinary ones
EXTREME_D = np.array([65504, -65504, 6e-8, -6e-8, 0, 1e-3, -0.5, 2.0], dtype=np.float16)


def random_q4_k(n: int, k: int, seed: int, extreme: bool = False) -> np.ndarray:
    """Valid Q4_K rows [n, k / 256 * 144]: random codes, 6-bit scales and mins (every byte pattern is data) with
    small d and dmin; `extreme`: every scale and min 63 in the first row, d and dmin from EXTREME_D, all codes 0 or
    15 in two rows."""
    raw = random_blocks(T.Q4_K, n, k, np.random.default_rng(seed))
    if extreme:
        blocks = raw.reshape(n, -1, 144)
        blocks[0, :, 4:16] = 0xFF  # sc = m = 63 for all 8 sub-blocks
        count = blocks.shape[0] * blocks.shape[1]
        d = EXTREME_D[np.arange(count) % len(EXTREME_D)]
        dmin = EXTREME_D[(np.arange(count) + 3) % len(EXTREME_D)]
        blocks[..., 0:2] = d.view(np.uint8).reshape(n, -1, 2)
        blocks[..., 2:4] = dmin.view(np.uint8).reshape(n, -1, 2)
        blocks[1, :, 16:] = 0  # q = 0: w = -dmin m
        blocks[2, :, 16:] = 0xFF  # q = 15
    return raw


@pytest.mark.parametrize("native", [True, False], ids=["native", "gguf"])
@pytest.mark.parametrize("extreme", [False, True], ids=["random", "extreme"])
def test_blocks_dequantize_bit_exactly_like_gguf(native, extreme):
    if native and kernels_disabled():
        pytest.skip("INFERNO_DISABLE_CPP_KERNELS=1")
    raw = random_q4_k(9, 1792, seed=extreme, extreme=extreme)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, T.Q4_K))
    blocks = Q4KBlocks(torch.from_numpy(raw))
    assert blocks.shape == (9, 1792)
    assert torch.equal(blocks.dequantize(native=native), expected)
    assert torch.equal(blocks.dequantize(torch.bfloat16, native=native), expected.bfloat16())


def kernel_reference(x: torch.Tensor, raw: np.ndarray) -> torch.Tensor:
    """The sums the kernel promises: the int8-rounded rows times the exact weights, in float64."""
    w = torch.from_numpy(gguf.quants.dequantize(raw, T.Q4_K)).double()
    return quantize_rows_like_q8(x).double() @ w.t()


def kernel_inputs(m: int, n: int, k: int) -> tuple[torch.Tensor, np.ndarray]:
    raw = random_q4_k(n, k, seed=m * k + n, extreme=True)
    blocks = raw.reshape(n, -1, 144)
    blocks[..., 0:4] = np.array([2e-3, 1e-3], dtype=np.float16).view(np.uint8)  # extreme codes and scales, ordinary d
    blocks[0, 0, 16:] = 0xFF  # weight row 0 starts with a whole super-block of codes 15: the largest sums
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[0, 32:64] = 0  # an all-zero block has scale 0
    x[-1, :64] = 3.0  # activation codes 127 against codes 0 / 15 and scales / mins 63
    x[-1, 64:96] = -3.0  # and -127
    return x, raw


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("k", [256, 512, 1792, 8960])  # 1, 2, 7 super-blocks; Qwen2.5-1.5B's ffn_down
def test_kernel_matches_float_sums_of_the_quantized_rows(m, k):
    x, raw = kernel_inputs(m, 37, k)  # 37 output rows: no whole thread chunk of 16
    y = torch.ops.inferno.q4_k_matmul(x, torch.from_numpy(raw))
    assert_close_to(y, kernel_reference(x, raw))


@needs_kernels
@EACH_ISA_LEVEL
def test_each_isa_level_computes_the_same_sums(tmp_path, level):
    """The AVX2 path (with AVX-VNNI where this CPU has it, and without: the maddubs sums of most AVX2 CPUs) and the
    plain loops, built on this CPU without the instructions they must not use (the first build takes about half a
    minute; later runs reuse it)."""
    xs_raws = [kernel_inputs(m, 37, 1792) for m in (1, 3, 5)]
    raw = xs_raws[0][1]
    xs = [x for x, _ in xs_raws]
    ys, w = isa_level_outputs(tmp_path, "q4_k", level, xs, torch.from_numpy(raw))
    assert torch.equal(w, torch.from_numpy(gguf.quants.dequantize(raw, T.Q4_K)))
    for x, y in zip(xs, ys):
        assert_close_to(y, kernel_reference(x, raw))


@pytest.mark.parametrize("rows", [1, 6, gemm_from_rows("q4_k") + 1])  # the last: dense GEMM
@pytest.mark.parametrize("native", [True, False], ids=["native", "pytorch"])
def test_linear_matches_its_dequantized_weight(rows, native):
    raw = random_q4_k(200, 512, seed=rows)
    layer = Q4KLinear(Q4KBlocks(torch.from_numpy(raw)), bias=torch.randn(200))
    if not native:
        layer.native = False
    elif kernels_disabled():
        pytest.skip("INFERNO_DISABLE_CPP_KERNELS=1")
    else:
        assert layer.native
    assert (layer.in_features, layer.out_features) == (512, 200)
    x = torch.randn(2, rows, 512, generator=torch.Generator().manual_seed(rows))
    ref = x @ torch.from_numpy(gguf.quants.dequantize(raw, T.Q4_K)).t() + layer.bias
    y = layer(x)
    assert y.shape == (2, rows, 200) and y.dtype == torch.float32
    assert ((y - ref).norm() / ref.norm()).item() < 3e-2  # int8-quantized activations (or the GEMM in compute_dtype)


def test_rows_permute_and_stack_like_the_weights():
    a, b = random_q4_k(8, 512, seed=1), random_q4_k(5, 512, seed=2)
    order = torch.tensor([3, 0, 7, 1, 6, 2, 5, 4])
    both = Q4KBlocks.cat([Q4KBlocks(torch.from_numpy(a)).map_rows(lambda t: t[order]), Q4KBlocks(torch.from_numpy(b))])
    expected = np.concatenate([gguf.quants.dequantize(a, T.Q4_K)[order.numpy()], gguf.quants.dequantize(b, T.Q4_K)])
    assert isinstance(both, Q4KBlocks) and both.shape == (13, 512)
    assert np.array_equal(both.dequantize().numpy(), expected)


def test_rows_stored_one_after_another_stack_without_a_copy(tmp_path):
    """A GGUF file stores a layer's ffn_gate then ffn_up: the fused gate_up_proj is a view of the file's map holding
    exactly both tensors' bytes; parts not adjacent (or not sharing a storage) are copied."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", T.Q4_K)
    gguf_file = GGUFFile(str(path))
    tensors = {t.name: t for t in gguf_file.tensors}
    gate, up = (tensors[f"blk.0.ffn_{kind}.weight"].rows() for kind in ("gate", "up"))
    assert gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
    stacked = Q4KBlocks.cat([Q4KBlocks(gate), Q4KBlocks(up)]).raw
    assert stacked.data_ptr() == gate.data_ptr() and torch.equal(stacked, torch.cat([gate, up]))
    loaded = load_model(str(path), torch.float32, quantization="auto").model.layers[0].mlp.gate_up_proj.weight
    assert loaded.untyped_storage().nbytes() == path.stat().st_size  # the loader's own map of the whole file
    assert torch.equal(loaded, torch.cat([gate, up]))
    down = tensors["blk.0.ffn_down.weight"].rows()  # same storage, not right after ffn_up
    for parts in ([up, gate], [gate, down[:, :gate.shape[1]].contiguous()]):
        copied = Q4KBlocks.cat([Q4KBlocks(p) for p in parts]).raw
        assert copied.data_ptr() not in (p.data_ptr() for p in parts) and torch.equal(copied, torch.cat(parts))


@needs_kernels
def test_kernel_rejects_bad_inputs():
    blocks = torch.from_numpy(random_q4_k(4, 512, seed=0))
    with pytest.raises(RuntimeError, match="x has 256 columns but the blocks hold 512"):
        torch.ops.inferno.q4_k_matmul(torch.randn(2, 256), blocks)
    with pytest.raises(RuntimeError, match="Q4_K super-blocks"):
        torch.ops.inferno.q4_k_matmul(torch.randn(2, 512), blocks[:, :200].contiguous())
    with pytest.raises(RuntimeError, match="x must be 2-D, float32"):
        torch.ops.inferno.q4_k_matmul(torch.randn(2, 512).double(), blocks)
    assert torch.ops.inferno.q4_k_matmul(torch.randn(0, 512), blocks).shape == (0, 4)


def untile(tiles: np.ndarray, n: int, k: int) -> np.ndarray:
    """Q4_K rows [n, k / 256 * 144] rebuilt from q4_k_tile's layout (the kernel file's description), to check that
    the tiles keep every value of the stored blocks."""
    supers = k // 256
    t = tiles.reshape(n // 16, supers, 2368)
    d, dmin = t[..., 0:32].view(np.float16), t[..., 32:64].view(np.float16)  # [tiles, supers, 16]
    sc, mn = t[..., 64:192].reshape(-1, supers, 8, 16), t[..., 192:320].reshape(-1, supers, 8, 16)
    groups = t[..., 320:].reshape(-1, supers, 32, 16, 4)  # [tiles, supers, group, row, c]
    codes = np.concatenate([groups & 0x0F, groups >> 4], axis=-1)  # columns 8 g + c, c < 8
    codes = codes.transpose(0, 3, 1, 2, 4).reshape(n, supers, 256)
    w = (d.transpose(0, 2, 1).reshape(n, supers, 1).astype(np.float32)
         * sc.transpose(0, 3, 1, 2).reshape(n, supers, 8).repeat(32, axis=2) * codes
         - dmin.transpose(0, 2, 1).reshape(n, supers, 1).astype(np.float32)
         * mn.transpose(0, 3, 1, 2).reshape(n, supers, 8).repeat(32, axis=2))
    return w.reshape(n, k)


@needs_kernels
@pytest.mark.parametrize("extreme", [False, True], ids=["random", "extreme"])
def test_tiles_keep_every_value_of_the_stored_blocks(extreme):
    raw = random_q4_k(32, 1792, seed=extreme, extreme=extreme)
    tiles = torch.ops.inferno.q4_k_tile(torch.from_numpy(raw)).numpy()
    assert tiles.shape == (2, 7 * 2368)
    expected = gguf.quants.dequantize(raw, T.Q4_K)
    # the same float32 products as gguf's (d * sc) * q - (dmin * m): bit for bit
    assert np.array_equal(untile(tiles, 32, 1792), expected, equal_nan=True)


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 8, 9, 40, 130])  # 130: two panels of rows (128 each)
@pytest.mark.parametrize("k", [256, 1792, 8960])
def test_tiles_kernel_matches_float_sums_of_the_quantized_rows(m, k):
    x, raw = kernel_inputs(m, 80, k)  # 5 tiles: a group of 4 and one more, split between threads
    tiles = torch.ops.inferno.q4_k_tile(torch.from_numpy(raw))
    assert_close_to(torch.ops.inferno.q4_k_tiles_matmul(x, tiles), kernel_reference(x, raw))


@needs_kernels
@EACH_ISA_LEVEL
def test_each_isa_level_of_the_tiles_kernel_computes_the_same_sums(tmp_path, level):
    xs_raws = [kernel_inputs(m, 48, 1792) for m in (1, 5)]
    raw = xs_raws[0][1]
    xs = [x for x, _ in xs_raws]
    ys = isa_level_tiles_outputs(tmp_path, "q4_k", level, xs, torch.from_numpy(raw))
    for x, y in zip(xs, ys):
        assert_close_to(y, kernel_reference(x, raw))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 6, gemm_from_rows("q4_k") + 1])
def test_tiled_linear_matches_its_dequantized_weight_at_every_batch_size(rows):
    raw = random_q4_k(208, 512, seed=rows)
    layer = Q4KLinear(Q4KBlocks(torch.from_numpy(raw)), bias=torch.randn(208))
    x = torch.randn(2, rows, 512, generator=torch.Generator().manual_seed(rows))
    untiled = layer(x)
    assert layer.can_tile and layer.unread_buffers == ()
    layer.tile()
    assert layer.tiles is not None and layer.unread_buffers == ("weight",)
    ref = x @ torch.from_numpy(gguf.quants.dequantize(raw, T.Q4_K)).t() + layer.bias
    y = layer(x)
    assert y.shape == (2, rows, 208)
    assert ((y - ref).norm() / ref.norm()).item() < 3e-2  # int8-quantized activations: 0.5 % typical, 1.5 % the worst of 1000 draws
    if rows < layer.gemm_from_rows:  # the same integer sums as the kernel on the stored blocks
        torch.testing.assert_close(y, untiled, rtol=1e-5, atol=1e-5 * untiled.abs().max().item())
    torch.testing.assert_close(layer.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, T.Q4_K)))


def test_a_weight_of_rows_not_a_multiple_of_16_is_not_tiled():
    layer = Q4KLinear(Q4KBlocks(torch.from_numpy(random_q4_k(200, 512, seed=0))))
    layer.tile()
    assert not layer.can_tile and layer.tiles is None


@needs_kernels
@pytest.mark.parametrize("qtype, layer_type", [(T.Q4_K, SuperBlockLinear), (T.Q4_1, Int4Linear)])
def test_the_engine_runs_every_step_on_tiles_of_its_4_bit_weights(tmp_path, monkeypatch, qtype, layer_type):
    """Every step runs the tiles, the first included (the runner makes them when it is built: never some layers of
    a step on each, nor some steps on the stored blocks), so a second engine gives the same log-probabilities bit
    for bit; the stored blocks are no longer among the weights moved onto huge pages."""
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", qtype))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    llm = LLM(path, kv_cache_memory=8 << 20, enforce_eager=True)
    runner = llm.llm_engine.model_runner
    layers = [m for m in runner.model.modules() if isinstance(m, layer_type)]
    assert layers and all(m.can_tile for m in layers)
    tiled_steps = []  # per step, whether each layer had its tiles
    forward_step = runner.forward_step

    def recording_forward_step(step):
        tiled_steps.append([m.tiles is not None for m in layers])
        return forward_step(step)

    monkeypatch.setattr(runner, "forward_step", recording_forward_step)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert len(tiled_steps) == 16 and all(all(step) for step in tiled_steps)
    again = LLM(path, kv_cache_memory=8 << 20, enforce_eager=True)
    assert [o.outputs[0].logprobs for o in again.generate(prompts, params, use_tqdm=False)] == \
        [o.logprobs for o in outputs]
    runner.wait_for_warm_up()
    ranges = weight_ranges(runner.model)
    for m in layers:
        start, end = tensor_span(m.weight)
        assert not any(s < end and start < e for s, e in ranges)
