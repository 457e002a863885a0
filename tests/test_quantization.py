"""Weight-only int8 / int4: the native group-wise int8 kernel and the packed kernels match dequantize-then-matmul,
GGUF Q4 blocks load without a float round trip, the quantized model stays close to float32 (group-wise int8: top-1
agreement >= 99 %) and its weights shrink by the expected factor."""
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import prefill_logits
from inferno import LLM, SamplingParams
from inferno.config import EngineConfig
from inferno.cpu_features import has_native_bfloat16
from inferno.kernels import quantized_gemv
from inferno.layers.quantization.groups import (GroupQuantized, quantize_groups, quantize_groups_symmetric,
                                                quantize_int4, quantize_int8)
from inferno.layers.quantization.int4 import Int4Linear
from inferno.layers.quantization.int8 import Int8GroupLinear, Int8Linear
from inferno.layers.quantization.q8 import Q8Linear
from inferno.layers.quantization.thresholds import gemm_from_rows
from inferno.loader.gguf_blocks import int4_groups
from native_kernels import needs_kernels, require_kernels

# Prose, code and chat; together ~150 next-token positions for the agreement checks.
TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden screw press into a system that could produce books far faster.",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n"
    "        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n",
    "<|im_start|>user\nWhat are three good habits for staying healthy?<|im_end|>\n<|im_start|>assistant\n"
    "1. Sleep seven to nine hours a night.\n2. Move every day.\n3. Eat mostly whole foods.<|im_end|>\n",
]


def linear(n: int, k: int, bias: bool = False) -> nn.Linear:
    torch.manual_seed(n + k)
    return nn.Linear(k, n, bias=bias)


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).norm() / ref.norm()).item()


def gguf_tensor(w: np.ndarray, kind: gguf.GGMLQuantizationType):
    class Tensor:  # a GGUF tensor's raw blocks and type
        data = gguf.quants.quantize(w, kind)
        tensor_type = kind
    return Tensor


def random_group_weight(n: int, k: int, group_size: int) -> GroupQuantized:
    torch.manual_seed(n * k + group_size)
    groups = -(-k // group_size)
    codes = torch.randint(0, 256, (n, groups * group_size), dtype=torch.uint8)
    return GroupQuantized(codes, torch.rand(n, groups) / 100, torch.randn(n, groups) / 10)




@needs_kernels
@pytest.mark.parametrize("m, n, k, group_size", [
    (1, 64, 64, 32), (1, 576, 576, 32), (3, 17, 96, 32), (4, 40, 256, 64), (5, 33, 576, 128),
    (9, 48, 1536, 32), (15, 8, 128, 128),
    (2, 24, 100, 32),  # a last, partial group of 4 columns
    (6, 16, 200, 48),  # group size not a multiple of the 16-lane vectors
    (1, 8, 7, 32),  # fewer columns than one group
    (40, 24, 160, 32),  # more rows than a decode step (the layer would dequantize instead)
])
def test_int8_group_kernel_matches_dequantize_then_matmul(m, n, k, group_size):
    weight = random_group_weight(n, k, group_size)
    x = torch.randn(m, k)
    ref = x.double() @ weight.dequantize()[:, :k].double().t()
    y = quantized_gemv().int8_group_matmul(x, weight.codes[:, :k].contiguous(), weight.scales, weight.mins, group_size)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@needs_kernels
def test_int8_group_kernel_rejects_bad_inputs():
    weight = random_group_weight(16, 64, 32)
    codes, scales, mins = weight.codes, weight.scales, weight.mins
    kernel = quantized_gemv().int8_group_matmul
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="x must be 2-D, float32, contiguous"):
        kernel(x.bfloat16(), codes, scales, mins, 32)
    with pytest.raises(RuntimeError, match="codes uint8"):
        kernel(x, codes.to(torch.int8), scales, mins, 32)
    with pytest.raises(RuntimeError, match="x has 48 columns but codes have 64"):
        kernel(x[:, :48].contiguous(), codes, scales, mins, 32)
    with pytest.raises(RuntimeError, match="scales and mins must be"):
        kernel(x, codes, scales[:, :1].contiguous(), mins, 32)
    with pytest.raises(RuntimeError, match="scales and mins must be"):
        kernel(x, codes, scales, mins, 64)  # 64 columns in groups of 64 need one scale per row, not two
    with pytest.raises(RuntimeError, match="x must be 2-D, float32, contiguous"):
        kernel(torch.randn(64, 2).t(), codes, scales, mins, 32)
    with pytest.raises(RuntimeError, match="codes, scales and mins must be contiguous"):
        kernel(x, codes, scales.t().contiguous().t(), mins, 32)
    with pytest.raises(RuntimeError, match="group_size must be positive"):
        kernel(x, codes, scales, mins, 0)
    with pytest.raises(RuntimeError, match="x must be 2-D"):
        kernel(x[0], codes, scales, mins, 32)
    with pytest.raises(RuntimeError, match="scales and mins must be float32"):
        quantized_gemv().int8_group_dequantize(codes, scales.double(), mins, 32)
    assert kernel(torch.randn(0, 64), codes, scales, mins, 32).shape == (0, 16)


@pytest.mark.parametrize("rows", [1, 5, gemm_from_rows("int8_group") + 3])  # the last: dequantize-then-GEMM
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("native", [True, False])  # False: the fallback without a C++ compiler
def test_int8_group_linear_matches_dequantized_reference(group_size, rows, native):
    lin = linear(128, 96, bias=True)  # 96 columns: a partial last group with 64 / 128
    layer = Int8GroupLinear.from_float(lin, group_size)
    if not native:
        layer.native = False
    else:
        require_kernels()
    x = torch.randn(2, rows, 96)  # leading dims are flattened and restored
    codes = F.pad(layer.weight, (0, -96 % group_size)).view(128, -1, group_size).float()
    ref = x @ (codes * layer.scales.unsqueeze(-1) + layer.mins.unsqueeze(-1)).view(128, -1)[:, :96].t() + lin.bias
    y = layer(x)
    assert y.shape == (2, rows, 128) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert relative_error(ref, lin(x)) < 1e-2  # and 8-bit groups are close to the float weights


def test_int8_groups_hold_gguf_q4_1_and_q8_0_blocks_exactly():
    """A Q4_1 block (min, (max - min) / 15) lies on the asymmetric 256-level grid of its group (255 = 15 * 17); a
    Q8_0 block is absmax / 127, the symmetric grid: re-quantizing the dequantized file gives back its weights."""
    w = np.random.default_rng(0).standard_normal((16, 128)).astype(np.float32)
    kind = gguf.GGMLQuantizationType.Q4_1
    stored = torch.from_numpy(gguf.quants.dequantize(gguf_tensor(w, kind).data, kind))
    torch.testing.assert_close(quantize_groups(stored, 32, bits=8).dequantize(), stored, rtol=0, atol=1e-6)
    kind = gguf.GGMLQuantizationType.Q8_0
    stored = torch.from_numpy(gguf.quants.dequantize(gguf_tensor(w, kind).data, kind))
    torch.testing.assert_close(quantize_groups_symmetric(stored, 32).dequantize(), stored, rtol=0, atol=1e-6)


@pytest.mark.parametrize("batch", [1, 7, 40])  # 40 rows: dequantize-then-GEMM path
def test_int8_per_channel_matmul_matches_dequantized_reference(batch):
    lin = linear(96, 64, bias=True)
    codes, scales = quantize_int8(lin.weight)
    x = torch.randn(batch, 64)
    ref = x @ (codes.float() * scales.unsqueeze(1)).t() + lin.bias
    assert relative_error(Int8Linear(codes, scales, lin.bias)(x), ref) < 1e-2  # bf16 activations
    assert relative_error(ref, lin(x)) < 2e-2  # and int8 itself is close to the float weights


@needs_kernels
def test_int4_kernel_rejects_bad_inputs():
    layer = Int4Linear(quantize_int4(torch.randn(16, 128), 32), None)
    kernel = quantized_gemv().int4_q8_matmul
    with pytest.raises(RuntimeError, match="x must be 2-D, float32, contiguous"):
        kernel(torch.randn(2, 128).bfloat16(), layer.weight, 32)
    with pytest.raises(RuntimeError, match="group_size must be 32, 64 or 128"):
        kernel(torch.randn(2, 128), layer.weight, 16)
    with pytest.raises(RuntimeError, match="a multiple of group_size"):
        kernel(torch.randn(2, 96), layer.weight, 64)
    with pytest.raises(RuntimeError, match="packed must be uint8"):
        kernel(torch.randn(2, 128), layer.weight, 64)  # 64-column groups: a shorter row
    assert kernel(torch.randn(0, 128), layer.weight, 32).shape == (0, 16)


@pytest.mark.parametrize("rows", [5, 100])  # 100 rows: dequantize-then-GEMM path
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_matmul_matches_dequantized_reference(group_size, rows):
    lin = linear(128, 96)  # 96 columns: padded up to a multiple of 64 / 128 (whole groups)
    x = torch.randn(rows, 96)
    padded = torch.nn.functional.pad(lin.weight, (0, -96 % group_size))
    ref = x @ quantize_int4(padded, group_size).dequantize()[:, :96].t()
    layer = Int4Linear.from_float(lin, group_size)
    assert relative_error(layer(x), ref) < 1e-2  # int8 (kernel) or bf16 (GEMM) activations, float16 scales
    layer.native = False  # the fallback without a C++ compiler
    assert relative_error(layer(x), ref) < 1e-2
    assert relative_error(ref, lin(x)) < 0.15


def test_quantize_int4_round_trips_values_on_its_grid():
    q = quantize_int4(torch.randn(8, 64), 32)
    assert q.codes.min() >= 0 and q.codes.max() <= 15
    again = quantize_int4(q.dequantize(), 32)
    assert torch.allclose(again.dequantize(), q.dequantize(), atol=1e-5)


@pytest.mark.parametrize("kind", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1])
def test_gguf_q4_blocks_read_as_codes_match_gguf_dequantize(kind):
    w = np.random.default_rng(0).standard_normal((16, 128)).astype(np.float32)
    tensor = gguf_tensor(w, kind)
    codes = int4_groups(tensor.data, kind)
    assert codes.group_size == 32
    np.testing.assert_array_equal(codes.dequantize().numpy(), gguf.quants.dequantize(tensor.data, kind))


@pytest.fixture(scope="module")
def reference_logits(llm):
    return [prefill_logits(llm.llm_engine, llm.get_tokenizer().encode(t)) for t in TEXTS]


@pytest.fixture(scope="module")
def int8_llm():
    # group-wise, groups of 32, float32 activations (dtype "auto" would be bfloat16 on CPUs with AVX512-BF16)
    return LLM(quantization="int8", dtype="float32", kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def int8_channel_llm():
    return LLM(quantization="int8", quantization_group_size=-1, kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def int4_llm():
    return LLM(quantization="int4", quantization_group_size=32, kv_cache_memory=64 << 20)


def top1_agreement(llm: LLM, reference: list[torch.Tensor]) -> float:
    ours = [prefill_logits(llm.llm_engine, llm.get_tokenizer().encode(t)) for t in TEXTS]
    return torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(ours, reference)]).float().mean().item()


def test_int8_model_agrees_with_float32(int8_llm, reference_logits):
    assert int8_llm.llm_engine.config.dtype == "float32"
    assert top1_agreement(int8_llm, reference_logits) >= 0.99


def test_int8_per_channel_model_agrees_with_float32(int8_channel_llm, reference_logits):
    # 99% is not reached per channel: the float32 reference is the dequantized Q4_1 file, which one scale per
    # row re-quantizes, and its bf16 activations alone already give 98.9% (benchmarks/quality.py)
    expected = "bfloat16" if has_native_bfloat16() else "float32"  # dtype "auto"
    assert int8_channel_llm.llm_engine.config.dtype == expected
    assert top1_agreement(int8_channel_llm, reference_logits) >= 0.95


def test_int4_model_agrees_with_float32(int4_llm, reference_logits):
    assert top1_agreement(int4_llm, reference_logits) >= 0.95


def test_int4_group_32_packs_gguf_q4_1_exactly(int4_llm, model_path):
    """Group 32 takes the file's Q4_1 blocks as they are: the packed layer computes with the stored weights."""
    reader = gguf.GGUFReader(model_path)
    stored = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    down = int4_llm.llm_engine.model_runner.model.layers[0].mlp.down_proj
    assert isinstance(down, Int4Linear) and down.group_size == 32
    weight = torch.from_numpy(gguf.quants.dequantize(stored.data, stored.tensor_type))
    torch.testing.assert_close(down.dequantize(), weight, rtol=0, atol=1e-6 * weight.abs().max().item())
    x = torch.randn(3, down.in_features)
    assert relative_error(down(x), x @ weight.t()) < 1e-2  # int8 activations


def test_int8_group_32_holds_gguf_q4_1_and_q8_0_exactly(int8_llm, model_path):
    """Group 32 takes the file's Q4_1 projection blocks as 8-bit codes, and its Q8_0 embedding (the tied LM head)
    re-quantizes to the same values: the group-wise int8 model computes with the stored weights."""
    reader = gguf.GGUFReader(model_path)
    stored = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)) for t in reader.tensors
              if t.name in ("blk.0.ffn_down.weight", "token_embd.weight")}
    model = int8_llm.llm_engine.model_runner.model
    down = model.layers[0].mlp.down_proj
    assert isinstance(down, Int8GroupLinear) and down.group_size == 32
    assert torch.equal(down.dequantize(), stored["blk.0.ffn_down.weight"])
    assert isinstance(model.lm_head, Int8GroupLinear) and model.lm_head.group_size == 32
    embedding = stored["token_embd.weight"]
    torch.testing.assert_close(model.lm_head.dequantize(), embedding, rtol=0, atol=1e-6 * embedding.abs().max().item())


def test_quantized_weights_shrink_by_the_expected_factor(llm, int8_llm, int8_channel_llm, int4_llm):
    kinds = (nn.Linear, Int8Linear, Int8GroupLinear, Int4Linear)
    projections = lambda m: [mod for mod in m.llm_engine.model_runner.model.layers.modules() if isinstance(mod, kinds)]
    float_bytes = sum(l.weight.numel() * l.weight.element_size() for l in projections(llm))
    group_layers = projections(int8_llm)
    int8_bytes = sum(l.weight.nbytes + l.scales.nbytes + l.mins.nbytes for l in group_layers)
    channel_layers = projections(int8_channel_llm)
    channel_bytes = sum(l.weight.nbytes + l.scales.nbytes for l in channel_layers)
    int4_layers = projections(int4_llm)
    int4_bytes = sum(l.weight.nbytes for l in int4_layers)  # codes, scales and mins in one buffer
    assert all(isinstance(l, Int8GroupLinear) and l.weight.dtype == torch.uint8 for l in group_layers)
    assert all(isinstance(l, Int8Linear) and l.weight.dtype == torch.int8 for l in channel_layers)
    assert all(l.weight.dtype == torch.uint8 for l in int4_layers)
    assert len(group_layers) == len(channel_layers) == len(int4_layers) == len(projections(llm))
    assert 3.1 < float_bytes / int8_bytes <= 3.2  # 1 byte per weight + float32 scale and min per 32 weights
    assert 3.9 < float_bytes / channel_bytes <= 4  # 1 byte per weight + a bf16 scale per output row
    assert 6.3 < float_bytes / int4_bytes <= 8  # half a byte per weight + float16 scale and min per 32 weights
    for quantized in (int8_channel_llm, int4_llm):  # Q8_0 groups: 1 byte per weight + a float32 scale per 32
        lm_head = quantized.llm_engine.model_runner.model.lm_head
        assert isinstance(lm_head, Q8Linear) and lm_head.weight.dtype == torch.int8
        assert lm_head.weight.nbytes + lm_head.scales.nbytes == lm_head.weight.numel() * (1 + 4 / 32)


@pytest.mark.parametrize("which", ["int8", "int8-channel", "int4"])
def test_quantized_greedy_generation_starts_like_float32(which, llm, int8_llm, int8_channel_llm, int4_llm):
    quantized = {"int8": int8_llm, "int8-channel": int8_channel_llm, "int4": int4_llm}[which]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids
    ours = quantized.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(ours) == 12
    assert ours[:4] == ref[:4]  # the answer itself; later tokens may drift with the rounding
    assert quantized.llm_engine.num_free_blocks == quantized.llm_engine.num_blocks


def test_int8_greedy_generation_equals_float32_where_the_margins_are_clear(llm, int8_llm):
    """Group-wise int8 holds this model's weights exactly: greedy output follows float32 as long as float32's own
    top-2 logit margin leaves room for summation-order differences."""
    prompt = "Write a short story about a robot who learns to paint."
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    ours = int8_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    prompt_ids = llm.get_tokenizer().encode(prompt)
    logits = prefill_logits(llm.llm_engine, prompt_ids + ref)[len(prompt_ids) - 1:-1]
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1] > 0.02).int()
    checked = int(clear.cumprod(0).sum())  # tokens up to the first narrow margin
    assert checked >= 8
    assert ours[:checked] == ref[:checked]


def test_bad_quantization_options_are_rejected():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size must be one of"):
        EngineConfig(quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="per output channel, int8 only"):
        EngineConfig(quantization="int4", quantization_group_size=-1)
    with pytest.raises(ValueError, match="quantization is not supported with tensor_parallel_size > 1"):
        EngineConfig(quantization="int4", tensor_parallel_size=2)
    assert EngineConfig(quantization="int8", pipeline_parallel_size=2).pipeline_parallel_size == 2
    auto_dtype = "bfloat16" if has_native_bfloat16() else "float32"  # dtype "auto": native bfloat16 GEMMs or not
    assert EngineConfig(quantization="int8").dtype == auto_dtype
    assert EngineConfig(quantization="int8", quantization_group_size=-1).dtype == auto_dtype
    assert EngineConfig(quantization=None).dtype == auto_dtype
    # float32 between the int4 kernels, which quantize their inputs to int8 themselves
    assert EngineConfig(quantization="int4").dtype == "float32"
    assert EngineConfig(quantization="int4").kv_cache_dtype == "float16"
