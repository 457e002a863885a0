"""Weight-only int8 / int4: packed kernels match dequantize-then-matmul, GGUF Q4 blocks load without a float round
trip, the quantized model stays close to float32 and its weights shrink by the expected factor."""
import gguf
import numpy as np
import pytest
import torch
from torch import nn

from conftest import prefill_logits
from inferno import LLM, SamplingParams
from inferno.layers.quantization import Int4Linear, Int8Linear, quantize_int4, quantize_int8
from inferno.loader.gguf import q4_codes

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


@pytest.mark.parametrize("batch", [1, 7, 40])  # 40 rows: dequantize-then-GEMM path
def test_int8_matmul_matches_dequantized_reference(batch):
    lin = linear(96, 64, bias=True)
    codes, scales = quantize_int8(lin.weight)
    x = torch.randn(batch, 64)
    ref = x @ (codes.float() * scales.unsqueeze(1)).t() + lin.bias
    assert relative_error(Int8Linear(codes, scales, lin.bias)(x), ref) < 1e-2  # bf16 activations
    assert relative_error(ref, lin(x)) < 2e-2  # and int8 itself is close to the float weights


@pytest.mark.parametrize("rows", [5, 100])  # 100 rows: dequantize-then-GEMM path
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_matmul_matches_dequantized_reference(group_size, rows):
    lin = linear(128, 96)  # 96 columns: padded up to a multiple of 64 / 128
    x = torch.randn(rows, 96)
    padded = torch.nn.functional.pad(lin.weight, (0, -96 % group_size))
    ref = x @ quantize_int4(padded, group_size).dequantize()[:, :96].t()
    assert relative_error(Int4Linear.from_float(lin, group_size)(x), ref) < 1e-2
    assert relative_error(ref, lin(x)) < 0.15


def test_quantize_int4_round_trips_values_on_its_grid():
    q = quantize_int4(torch.randn(8, 64), 32)
    assert q.codes.min() >= 0 and q.codes.max() <= 15
    again = quantize_int4(q.dequantize(), 32)
    assert torch.allclose(again.dequantize(), q.dequantize(), atol=1e-5)


@pytest.mark.parametrize("kind", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1])
def test_gguf_q4_blocks_read_as_codes_match_gguf_dequantize(kind):
    w = np.random.default_rng(0).standard_normal((16, 128)).astype(np.float32)

    class Tensor:  # the two fields of gguf.ReaderTensor that q4_codes reads
        data = gguf.quants.quantize(w, kind)
        tensor_type = kind

    codes = q4_codes(Tensor)
    assert codes.group_size == 32
    np.testing.assert_array_equal(codes.dequantize().numpy(), gguf.quants.dequantize(Tensor.data, kind))


@pytest.fixture(scope="module")
def reference_logits(llm):
    return [prefill_logits(llm.llm_engine, llm.get_tokenizer().encode(t)) for t in TEXTS]


@pytest.fixture(scope="module")
def int8_llm():
    return LLM(quantization="int8", kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def int4_llm():
    return LLM(quantization="int4", quantization_group_size=32, kv_cache_memory=64 << 20)


def top1_agreement(llm: LLM, reference: list[torch.Tensor]) -> float:
    ours = [prefill_logits(llm.llm_engine, llm.get_tokenizer().encode(t)) for t in TEXTS]
    return torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(ours, reference)]).float().mean().item()


def test_int8_model_agrees_with_float32(int8_llm, reference_logits):
    # 99% is not reached on this model: its float32 reference is itself the dequantized Q4_1 file, which
    # per-channel int8 re-quantizes, and bf16 activations alone already give 98.9% (benchmarks/quality.py)
    assert top1_agreement(int8_llm, reference_logits) >= 0.95


def test_int4_model_agrees_with_float32(int4_llm, reference_logits):
    assert top1_agreement(int4_llm, reference_logits) >= 0.95


def test_int4_group_32_packs_gguf_q4_1_exactly(int4_llm, model_path):
    """Group 32 takes the file's Q4_1 blocks as they are: the packed layer computes with the stored weights."""
    reader = gguf.GGUFReader(model_path)
    stored = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    down = int4_llm.llm_engine.model_runner.model.layers[0].mlp.down_proj
    assert isinstance(down, Int4Linear) and down.group_size == 32
    x = torch.randn(3, down.in_features)
    ref = x @ torch.from_numpy(gguf.quants.dequantize(stored.data, stored.tensor_type)).t()
    assert relative_error(down(x), ref) < 1e-2  # only bf16 activations and bf16 scales differ


def test_quantized_weights_shrink_by_the_expected_factor(llm, int8_llm, int4_llm):
    projections = lambda m: [mod for mod in m.layers.modules() if isinstance(mod, (nn.Linear, Int8Linear, Int4Linear))]
    float_bytes = sum(l.weight.numel() * 4 for l in projections(llm.llm_engine.model_runner.model))
    int8_bytes = sum(l.weight.numel() + l.scales.numel() * 2 for l in projections(int8_llm.llm_engine.model_runner.model))
    int4_layers = projections(int4_llm.llm_engine.model_runner.model)
    int4_bytes = sum(l.weight.numel() + l.scales_and_zeros.numel() * 2 for l in int4_layers)
    assert all(l.weight.dtype == torch.int8 for l in projections(int8_llm.llm_engine.model_runner.model))
    assert all(l.weight.dtype == torch.uint8 for l in int4_layers)
    assert 3.9 < float_bytes / int8_bytes <= 4  # 1 byte per weight + a bf16 scale per output row
    assert 6.3 < float_bytes / int4_bytes <= 8  # half a byte per weight + bf16 scale and zero per 32 weights
    lm_head = int8_llm.llm_engine.model_runner.model.lm_head
    assert isinstance(lm_head, Int8Linear) and lm_head.weight.dtype == torch.int8


@pytest.mark.parametrize("which", ["int8", "int4"])
def test_quantized_greedy_generation_starts_like_float32(which, llm, int8_llm, int4_llm):
    quantized = int8_llm if which == "int8" else int4_llm
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids
    ours = quantized.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(ours) == 12
    assert ours[:4] == ref[:4]  # the answer itself; later tokens may drift with the rounding
    assert quantized.llm_engine.num_free_blocks == quantized.llm_engine.num_blocks


def test_bad_quantization_options_are_rejected():
    from inferno.config import EngineConfig
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size must be one of"):
        EngineConfig(quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="quantization is not supported with tensor_parallel_size > 1"):
        EngineConfig(quantization="int4", tensor_parallel_size=2)
    assert EngineConfig(quantization="int8", pipeline_parallel_size=2).pipeline_parallel_size == 2
    assert EngineConfig(quantization="int8").dtype == "bfloat16"
    assert EngineConfig().dtype == "float32"
