"""W8A8 with calibrated activation thresholds: the entropy calibration picks the KL-minimising threshold (checked
against a brute force), thresholds stay within the absmax seen, the int8 x int8 layer stays close to float, and
the `inferno calibrate` file is what `LLM(quantization="w8a8")` loads (bad or missing files are a ValueError)."""
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import FLOAT32, prefill_logits
from inferno import LLM
from inferno.entrypoints.cli import main
from inferno.layers.activation_calibration import QUANTIZED_BINS, SMOOTHING, entropy_threshold, smoothing_factors
from inferno.layers.w8a8 import W8A8_FROM_ROWS, W8A8Linear
from test_architectures import prompts
from tiny_models import write_hf_model


def brute_force_kl(hist: list[float], i: int) -> float:
    """KL(P || Q) for clipping after bin i, bin by bin: P is the histogram clipped into its first i bins; Q merges
    those i bins into QUANTIZED_BINS runs and spreads each run's mass evenly over its non-empty bins, and gives a
    bin where P has mass and Q none SMOOTHING of its normalised mass."""
    p = hist[:i]
    p[-1] += sum(hist[i:])
    q = [0.0] * i
    for run in range(QUANTIZED_BINS):
        start, stop = run * i // QUANTIZED_BINS, (run + 1) * i // QUANTIZED_BINS
        filled = [b for b in range(start, stop) if hist[b] > 0]
        for b in filled:
            q[b] = sum(hist[start:stop]) / len(filled)
    q = [qb / sum(q) for qb in q]
    q = [SMOOTHING if pb > 0 and qb == 0 else qb for pb, qb in zip(p, q)]
    total_p, total_q = sum(p), sum(q)
    return sum(pb / total_p * math.log((pb / total_p) / (qb / total_q)) for pb, qb in zip(p, q) if pb > 0)


def test_entropy_threshold_clips_an_outlier_and_minimises_kl():
    rng = np.random.default_rng(0)
    values = np.abs(np.concatenate([rng.standard_normal(20000), [40.0, -38.0]]))  # a bulk and two outliers
    bins = 512
    hist = np.histogram(values, bins=bins, range=(0, values.max()))[0].astype(np.float64)
    threshold = entropy_threshold(hist, values.max())
    kls = {i: brute_force_kl(hist.tolist(), i) for i in range(QUANTIZED_BINS, bins + 1)}
    best = min(kls, key=kls.get)
    assert threshold == pytest.approx(values.max() * best / bins)
    assert 2.0 < threshold < 0.5 * values.max()  # the outliers are clipped, the bulk (|x| < ~4) is kept


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


def test_calibrated_thresholds_stay_within_absmax(calibration_file):
    layers = json.loads(calibration_file.read_text())["layers"]
    expected = {f"layers.{i}.{name}" for i in range(2)
                for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    assert set(layers) == expected
    assert all(0 < entry["threshold"] <= entry["absmax"] for entry in layers.values())
    assert any(entry["threshold"] < entry["absmax"] for entry in layers.values())


def test_w8a8_linear_is_close_to_float():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96)
    outliers = torch.ones(256)
    outliers[[3, 77]] = 30.0  # two input channels with outliers, which smoothing scales down
    for rows in (W8A8_FROM_ROWS, 100, 3):  # int8 x int8, and the weight-only path of decode-sized batches
        x = torch.randn(rows, 256) * outliers
        want = F.linear(x, linear.weight, linear.bias)
        smoothing = smoothing_factors(x.abs().amax(dim=0), linear.weight, 0.5)
        errors = []
        for s in (None, smoothing):
            threshold = (x.abs() if s is None else x.abs() / s).max().item()
            y = W8A8Linear(linear.weight, linear.bias, threshold, s)(x)
            errors.append(((y - want).norm() / want.norm()).item())
        assert errors[1] < 2e-2 and (rows < W8A8_FROM_ROWS or errors[1] < errors[0])  # smoothing helps int8 inputs
    layer = W8A8Linear(linear.weight, linear.bias, threshold, smoothing)
    layer.native = False  # the integer product on the PyTorch path: the same integers, the same result
    x = torch.randn(64, 256) * outliers
    torch.testing.assert_close(layer(x), W8A8Linear(linear.weight, linear.bias, threshold, smoothing)(x),
                               rtol=1e-5, atol=1e-5)


def test_calibrate_cli_writes_the_file_llm_loads(tiny_folder, calibration_file):
    float_llm = LLM(str(tiny_folder), **FLOAT32, kv_cache_memory=8 << 20)
    w8a8 = LLM(str(tiny_folder), dtype="float32", quantization="w8a8", calibration=str(calibration_file),
               kv_cache_memory=8 << 20)
    layers = [m for m in w8a8.llm_engine.model_runner.model.modules() if isinstance(m, W8A8Linear)]
    thresholds = json.loads(calibration_file.read_text())["layers"]
    assert len(layers) == len(thresholds) == 8
    assert sorted(m.threshold for m in layers) == sorted(e["threshold"] for e in thresholds.values())
    ids = prompts([80])[0]
    ref, ours = prefill_logits(float_llm.llm_engine, ids), prefill_logits(w8a8.llm_engine, ids)
    assert ((ours - ref).norm() / ref.norm()).item() < 0.2  # random weights, calibrated on other text


def test_calibration_beside_the_model_is_the_default(tmp_path):
    write_hf_model(tmp_path, "llama")
    main(["calibrate", str(tmp_path), "--method", "absmax", "--num-threads", "1"])
    document = json.loads((tmp_path / "activation_calibration.json").read_text())
    assert document["method"] == "absmax"
    assert all(e["threshold"] == e["absmax"] for e in document["layers"].values())
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
    with pytest.raises(ValueError, match="does not fit this model: 1 of its layers have no threshold"):
        LLM(str(tiny_folder), calibration=str(tmp_path / "partial.json"), **args)
    document = json.loads(calibration_file.read_text())
    document["layers"]["layers.0.mlp.down_proj"]["smoothing"] = [1.0] * 3
    (tmp_path / "short.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match="has 128 inputs but 3 smoothing factors"):
        LLM(str(tiny_folder), calibration=str(tmp_path / "short.json"), **args)
    document["layers"]["layers.0.mlp.down_proj"]["threshold"] = -1.0
    (tmp_path / "negative.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match="expected a positive number"):
        LLM(str(tiny_folder), calibration=str(tmp_path / "negative.json"), **args)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(str(tiny_folder), calibration=str(tmp_path / "broken.json"), **args)
    with pytest.raises(ValueError, match="calibration is used only with quantization='w8a8'"):
        LLM(str(tiny_folder), calibration=str(calibration_file), **FLOAT32)
