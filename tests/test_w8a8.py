"""W8A8 with calibrated SmoothQuant factors: the int8 x int8 layer stays close to float (smoothing and down_proj's
rotation help), folding the smoothing into the operation before a projection leaves the float model's output as it
was, and the `inferno calibrate` file is what `LLM(quantization="w8a8")` loads (bad, old or missing files are a
ValueError)."""
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import FLOAT32, prefill_logits
from inferno import LLM
from inferno.entrypoints.cli import main
from inferno.layers.quantization.activation_calibration import SMOOTHING, smoothing_factors
from inferno.layers.quantization.thresholds import gemm_from_rows
from inferno.layers.quantization.w8a8 import WEIGHT_LEVELS, W8A8Linear, hadamard, quantize_w8a8, rotate
from native_kernels import needs_kernels
from test_architectures import prompts
from tiny_models import write_hf_model


def test_block_rotation_is_orthonormal():
    h = hadamard(64)
    torch.testing.assert_close(h @ h.T, torch.eye(64), atol=1e-6, rtol=0)
    x, w = torch.randn(5, 128), torch.randn(7, 128)
    torch.testing.assert_close(rotate(x, h) @ rotate(w, h).T, x @ w.T, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    write_hf_model(folder, "llama")
    return folder


@pytest.fixture(scope="module")
def calibration_file(tiny_folder):
    path = tiny_folder.parent / "calibration.json"
    main(["calibrate", str(tiny_folder), "--output", str(path), "--num-threads", "1"])
    return path


def test_calibration_file_has_factors_for_every_projection(calibration_file):
    document = json.loads(calibration_file.read_text())
    assert document["version"] == 2 and document["smoothing"] is None  # each projection type's own strength
    layers = document["layers"]
    expected = {f"layers.{i}.{name}" for i in range(2)
                for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    assert set(layers) == expected
    assert all(len(e["smoothing"]) in (64, 128) and min(e["smoothing"]) > 0 for e in layers.values())
    assert all(e["smoothing"] == [1.0] * 64 for name, e in layers.items() if name.endswith("o_proj"))
    assert SMOOTHING["o_proj"] == 0 and all(SMOOTHING[k] > 0 for k in ("qkv_proj", "gate_up_proj", "down_proj"))


def int8_error(linear: torch.nn.Linear, x: torch.Tensor, smoothing: torch.Tensor | None, rotated: bool) -> float:
    """Relative error of a W8A8Linear fed x / smoothing (what the operation before it gives once folded)."""
    s = torch.ones(linear.in_features) if smoothing is None else smoothing
    want = F.linear(x, linear.weight, linear.bias)
    y = W8A8Linear(linear.weight * s, linear.bias, rotated=rotated)(x / s)
    return ((y - want).norm() / want.norm()).item()


def test_w8a8_linear_is_close_to_float():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96)
    outliers = torch.ones(256)
    outliers[[3, 77]] = 30.0  # two input channels with outliers, which smoothing scales down
    for rows in (gemm_from_rows("w8a8"), 100, 3):  # int8 x int8, and the weight-only path of decode-sized batches
        x = torch.randn(rows, 256) * outliers
        smoothing = smoothing_factors(x.abs().amax(dim=0), linear.weight, 0.5)
        plain, smoothed = int8_error(linear, x, None, False), int8_error(linear, x, smoothing, False)
        assert smoothed < 2e-2 and (rows < gemm_from_rows("w8a8") or smoothed < plain)  # smoothing helps int8 inputs
    x = torch.randn(64, 256)
    x[5, 10] = 200.0  # one token with a massive activation: the rotation spreads it over its block of 64
    # the error about halves (a little less with 7-bit weights, CPUs without VNNI: their own rounding stays)
    gain = 0.5 if WEIGHT_LEVELS == 127 else 0.6
    assert int8_error(linear, x, None, True) < gain * int8_error(linear, x, None, False)
    layer = W8A8Linear(linear.weight, linear.bias, 1 / smoothing, rotated=True)
    layer.onednn = False  # the integer product on the PyTorch path: the same integers, the same result
    torch.testing.assert_close(layer(x), W8A8Linear(linear.weight, linear.bias, 1 / smoothing, rotated=True)(x),
                               rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("in_features", [256, 1536, 24])  # 24: a rotation block of 8, narrower than a vector
def test_native_input_quantization_matches_pytorch(rotated, in_features):
    """The one-pass kernel (scale, Hadamard transform, quantize) gives the PyTorch path's row scales and codes; a
    code may differ by one where the transform and the matmul round a tie differently. bfloat16 rows as their float32
    values."""
    torch.manual_seed(in_features)
    x = torch.randn(37, in_features) * 3
    x[:, 5] *= 40  # an outlier channel
    layer = W8A8Linear(torch.randn(16, in_features), None, torch.rand(in_features) + 0.5, rotated=rotated)
    assert layer.kernels is not None
    for rows in (x, x.bfloat16()):
        codes, scales = layer.quantize_input(rows)
        ref_codes, ref_scales = W8A8Linear.quantize_rows(layer.prepare_input(rows))
        torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
        difference = (codes.int() - ref_codes.int()).abs()
        assert difference.max().item() <= 1 and (difference > 0).float().mean().item() < 1e-3
        assert codes.dtype == torch.uint8 and codes.float().sub(128).abs().amax(dim=1).eq(127).all()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_native_output_scaling_matches_pytorch(dtype, bias):
    """The GEMM's output times the row scales plus the bias in one pass, in the input's dtype: the PyTorch ops'
    result (float32 to rounding; bfloat16 at most one unit in the last place apart, where a fused multiply-add
    rounds a tie the other way)."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(128, 72, bias=bias)  # 72 outputs: a tail shorter than a vector
    x = torch.randn(gemm_from_rows("w8a8") + 3, 128).to(dtype)
    layer = W8A8Linear(linear.weight, linear.bias)
    y = layer(x)
    layer.kernels = None
    reference = layer(x)
    assert y.dtype == dtype and y.shape == reference.shape
    if dtype == torch.float32:
        torch.testing.assert_close(y, reference, rtol=1e-6, atol=1e-6)
    else:
        ulps = (y.view(torch.int16).int() - reference.view(torch.int16).int()).abs()
        assert ulps.max().item() <= 1 and (ulps > 0).float().mean().item() < 0.01


def test_folded_smoothing_leaves_the_float_model_unchanged(tiny_folder, calibration_file):
    """With the int8 layers swapped back for float ones, the folded factors (norm weights, up rows) cancel out."""
    llm = LLM(str(tiny_folder), **FLOAT32, kv_cache_memory=8 << 20)
    model = llm.llm_engine.model_runner.model
    ids = prompts([40])[0]
    ref = prefill_logits(llm.llm_engine, ids)
    smoothing = {name: torch.tensor(e["smoothing"]) for name, e in
                 json.loads(calibration_file.read_text())["layers"].items()}
    norm = model.layers[0].input_layernorm.weight
    before = norm.clone()
    quantize_w8a8(model, smoothing)
    torch.testing.assert_close(norm, before / smoothing["layers.0.self_attn.qkv_proj"])  # QKV's factors folded
    for name, module in list(model.named_modules()):
        if isinstance(module, W8A8Linear):  # an exact float layer with the same (smoothed, rotated) weights
            codes = module.weight.float() * module.scales.unsqueeze(1)
            w = codes if module.rotation is None else rotate(codes, module.rotation)  # H is its own inverse
            exact = torch.nn.Linear(module.in_features, module.out_features, bias=False)
            exact.weight.data = w if module.input_scales is None else w * module.input_scales
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, exact)
    ours = prefill_logits(llm.llm_engine, ids)
    # only the weights' rounding is left, its step twice as large with 7-bit codes (CPUs without VNNI)
    assert ((ours - ref).norm() / ref.norm()).item() < 0.05 * 127 / WEIGHT_LEVELS


def test_calibrate_cli_writes_the_file_llm_loads(tiny_folder, calibration_file):
    float_llm = LLM(str(tiny_folder), **FLOAT32, kv_cache_memory=8 << 20)
    w8a8 = LLM(str(tiny_folder), dtype="float32", quantization="w8a8", calibration=str(calibration_file),
               kv_cache_memory=8 << 20)
    layers = [m for m in w8a8.llm_engine.model_runner.model.modules() if isinstance(m, W8A8Linear)]
    assert len(layers) == len(json.loads(calibration_file.read_text())["layers"]) == 8
    assert sum(m.rotation is not None for m in layers) == 2  # the down projections
    ids = prompts([80])[0]
    ref, ours = prefill_logits(float_llm.llm_engine, ids), prefill_logits(w8a8.llm_engine, ids)
    assert ((ours - ref).norm() / ref.norm()).item() < 0.2  # random weights, calibrated on other text


def test_calibration_beside_the_model_is_the_default(tmp_path):
    write_hf_model(tmp_path, "llama")
    main(["calibrate", str(tmp_path), "--smoothing", "0", "--num-threads", "1"])
    document = json.loads((tmp_path / "activation_calibration.json").read_text())
    assert document["smoothing"] == 0
    assert all(set(e["smoothing"]) == {1.0} for e in document["layers"].values())
    llm = LLM(str(tmp_path), dtype="float32", quantization="w8a8", kv_cache_memory=8 << 20)
    assert any(isinstance(m, W8A8Linear) for m in llm.llm_engine.model_runner.model.modules())


def test_missing_or_mismatched_calibration_is_a_value_error(tmp_path, tiny_folder, calibration_file):
    args = dict(dtype="float32", quantization="w8a8", kv_cache_memory=8 << 20)
    with pytest.raises(ValueError, match="does not exist.*inferno calibrate"):
        LLM(str(tiny_folder), calibration=str(tmp_path / "nothing.json"), **args)
    other = tmp_path / "wider"
    write_hf_model(other, "llama", hidden_size=128, intermediate_size=256)
    with pytest.raises(ValueError, match="was made for another model"):
        LLM(str(other), calibration=str(calibration_file), **args)
    document = json.loads(calibration_file.read_text())
    del document["layers"]["layers.1.mlp.down_proj"]
    (tmp_path / "partial.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match="does not fit this model: 1 of its layers have no smoothing factors"):
        LLM(str(tiny_folder), calibration=str(tmp_path / "partial.json"), **args)
    document = json.loads(calibration_file.read_text())
    document["layers"]["layers.0.mlp.down_proj"]["smoothing"] = [1.0] * 3
    (tmp_path / "short.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match="has 128 inputs but 3 smoothing factors"):
        LLM(str(tiny_folder), calibration=str(tmp_path / "short.json"), **args)
    document["layers"]["layers.0.mlp.down_proj"]["smoothing"] = [-1.0] * 128
    (tmp_path / "negative.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match="needs a list of positive smoothing factors"):
        LLM(str(tiny_folder), calibration=str(tmp_path / "negative.json"), **args)
    document["version"] = 1
    (tmp_path / "version1.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match="is version 1 .* `inferno calibrate"):
        LLM(str(tiny_folder), calibration=str(tmp_path / "version1.json"), **args)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(str(tiny_folder), calibration=str(tmp_path / "broken.json"), **args)
    with pytest.raises(ValueError, match="calibration is used only with quantization='w8a8'"):
        LLM(str(tiny_folder), calibration=str(calibration_file), **FLOAT32)
