"""AWQ and GPTQ checkpoints: a tiny llama whose projections are known 4-bit codes, scales and zero points, packed by
the test in each format's layout (AutoAWQ's WQLinear_GEMM, AutoGPTQ's QuantLinear), loads with exactly those
integers in the int4 kernel's layout, and computes what HF transformers computes with the dequantized weights."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FLOAT32, is_near_tie, prefill_logits
from inferno import LLM, SamplingParams
from inferno.layers.quantization.groups import ZeroPointInt4
from inferno.layers.quantization.int4 import Int4Linear, unpack_int4
from inferno.layers.rotary import interleave_rotary_rows
from inferno.worker import tiles
from test_architectures import hf_greedy, prompts
from tiny_models import write_hf_model

SHAPE = dict(hidden_size=128, intermediate_size=256)  # room for groups of 128
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i holds output 8c + AWQ_PACK_ORDER[i] (AutoAWQ's pack)
LOGIT_TOLERANCE = 1e-3  # the dense path on the dequantized weights, float32
GREEDY_LOGIT_TOLERANCE = 0.01  # HF's cached decode sums in another order
# relative error of the int4 kernel's logits, whose activations are quantized to int8 per block of 32 (measured:
# 0.006-0.055 on these random models)
KERNEL_LOGIT_TOLERANCE = 0.1


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_kernel_with_zero_points_matches_dequantized_weights(group_size):
    generator = torch.Generator().manual_seed(group_size)
    n, k = 48, 384
    weight = ZeroPointInt4(torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8),
                           (0.01 * torch.rand(n, k // group_size, generator=generator)).half(),
                           zeros=torch.randint(0, 17, (n, k // group_size), generator=generator, dtype=torch.uint8))
    layer = Int4Linear(weight, None)
    reference = weight.dequantize()  # (codes - zeros) * scales, exact in float32
    x = torch.randn(5, k, generator=generator)
    for native in (True, False):  # the kernels, and the PyTorch fallback without a C++ compiler
        layer.native = native and layer.native
        assert torch.equal(layer.dequantize(), reference)
        y, want = layer(x), x @ reference.t()
        assert ((y - want).norm() / want.norm()).item() < 1e-2  # int8 activations (kernel) or exact (fallback)


def pack_nibbles(values: torch.Tensor, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """Integers in [0, 15] -> int32 with 8 of them per value along `dim`: nibble i of packed j holds
    values[8j + order[i]] (order: plain by default)."""
    values = values.movedim(dim, 0).to(torch.int64)
    order = order or list(range(8))
    packed = torch.zeros(values.shape[0] // 8, *values.shape[1:], dtype=torch.int64)
    for i, source in enumerate(order):
        packed |= values[source::8] << (4 * i)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32).movedim(0, dim)


def quantized_tensors(name: str, codes, scales, zeros, method: str, group_size: int) -> dict[str, torch.Tensor]:
    """codes [out, in], scales (float16) and zeros [out, in / group] in the checkpoint format of `method`."""
    if method == "awq":
        return {f"{name}.qweight": pack_nibbles(codes.t(), 1, AWQ_PACK_ORDER),
                f"{name}.qzeros": pack_nibbles(zeros.t(), 1, AWQ_PACK_ORDER), f"{name}.scales": scales.t().contiguous()}
    stored_zeros = zeros - 1 if method == "gptq" else zeros  # v1 stores zero - 1
    g_idx = torch.arange(codes.shape[1], dtype=torch.int32) // group_size
    return {f"{name}.qweight": pack_nibbles(codes.t(), 0), f"{name}.qzeros": pack_nibbles(stored_zeros.t(), 1),
            f"{name}.scales": scales.t().contiguous(), f"{name}.g_idx": g_idx}


def quantization_config(method: str, group_size: int, desc_act: bool = False) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": False,
            "checkpoint_format": method}


def write_quantized_llama(folder, method: str, group_size: int, desc_act: bool = False):
    """A tiny llama in `folder` whose projections are random codes, scales and zeros in `method`'s format; returns
    the HF model holding the dequantized weights (float32) and the integers of each projection."""
    hf_model = write_hf_model(folder, "llama", **SHAPE)
    with torch.no_grad():
        hf_model.lm_head.weight.mul_(4)  # logits spread wide enough for clear greedy choices
    generator = torch.Generator().manual_seed(group_size)
    tensors = dict(hf_model.state_dict())
    stored = {}
    for name, module in hf_model.named_modules():
        if not name.endswith(PROJECTIONS):
            continue
        out_features, in_features = module.weight.shape
        groups = in_features // group_size
        codes = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
        low = 1 if method == "gptq" else 0  # v1 zeros are stored minus one, in 4 bits
        zeros = torch.randint(low, low + 16, (out_features, groups), generator=generator, dtype=torch.uint8)
        scales = (0.005 + 0.015 * torch.rand(out_features, groups, generator=generator)).half()
        with torch.no_grad():
            weight = (codes.float() - zeros.float().repeat_interleave(group_size, 1)) * \
                scales.float().repeat_interleave(group_size, 1)
            module.weight.copy_(weight)
        del tensors[f"{name}.weight"]
        tensors.update(quantized_tensors(name, codes, scales, zeros, method, group_size))
        stored[name.removeprefix("model.")] = (codes, scales, zeros)
    for file in folder.glob("*.safetensors"):
        file.unlink()
    save_file({name: t.contiguous() for name, t in tensors.items()}, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, group_size, desc_act)
    (folder / "config.json").write_text(json.dumps(config))
    return hf_model, stored


def kernel_layout(layer: Int4Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes, float16 scales and zero points stored in an Int4Linear's rows."""
    k, groups = layer.padded_in_features, layer.padded_in_features // layer.group_size
    halves = layer.weight[:, k // 2:].contiguous().view(torch.float16)
    return unpack_int4(layer.weight[:, :k // 2]), halves[:, :groups], halves[:, groups:]


def expected_layout(stored: dict, layer: int, projections: tuple[str, ...], heads: dict[str, int]):
    """The integers of a (fused) layer's projections stacked as the model holds them (Q/K rows in rotary order)."""
    parts = []
    for proj in projections:
        module = "self_attn" if proj in PROJECTIONS[:4] else "mlp"
        tensors = stored[f"layers.{layer}.{module}.{proj}"]
        parts.append([interleave_rotary_rows(t, heads[proj]) if proj in heads else t for t in tensors])
    return [torch.cat(column) for column in zip(*parts)]


@pytest.mark.parametrize("method, group_size", [("awq", 32), ("awq", 64), ("awq", 128), ("gptq", 32), ("gptq", 64),
                                                ("gptq", 128), ("gptq_v2", 64)])
def test_quantized_checkpoint_loads_its_integers_and_matches_hf(tmp_path, monkeypatch, method, group_size):
    hf_model, stored = write_quantized_llama(tmp_path, method, group_size)
    # no int4 tiles: their kernel (int8 activations, as the packed rows' kernel) would replace the dense float32 path
    # that the greedy tokens below are compared on
    monkeypatch.setattr(tiles, "tile_weights", lambda layers: None)
    # quantization "auto"; a float32 cache: prefill reads its own K/V rounded to the cache's dtype
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="float32", kv_cache_memory=8 << 20)
    model = llm.llm_engine.model_runner.model
    config = hf_model.config
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    fused = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
             "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}
    for layer in range(config.num_hidden_layers):
        for name, projections in fused.items():
            module = model.layers[layer].get_submodule(name)
            assert isinstance(module, Int4Linear) and module.zero_points and module.group_size == group_size
            codes, scales, zeros = kernel_layout(module)
            want_codes, want_scales, want_zeros = expected_layout(stored, layer, projections, heads)
            assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
            assert torch.equal(zeros, want_zeros.half())

    prompt = prompts([60])[0]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    kernel_logits = prefill_logits(llm.llm_engine, prompt)  # 60 rows: the int4 kernel on every CPU
    assert ((kernel_logits - ref).norm() / ref.norm()).item() < KERNEL_LOGIT_TOLERANCE
    for layer in (m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, Int4Linear)):
        monkeypatch.setattr(layer, "gemm_from_rows", 1)  # the dense path: exact weights, float32
        monkeypatch.setattr(layer, "compute_dtype", torch.float32)
        monkeypatch.setattr(layer, "tiles", None)  # every pass runs the tiles, made by the first
    assert (prefill_logits(llm.llm_engine, prompt) - ref).abs().max().item() < LOGIT_TOLERANCE
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    compared = 0
    for ids in prompts([5, 23, 40]):
        ref_tokens, gaps = hf_greedy(hf_model, ids)
        ours = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
        clear = next((i for i, gap in enumerate(gaps) if is_near_tie(gap, GREEDY_LOGIT_TOLERANCE)), len(gaps))
        assert ours[:clear] == ref_tokens[:clear]
        compared += clear
    assert compared >= 8, "HF's near-ties leave too few tokens to compare; pick other prompts"


def test_quantized_checkpoint_without_native_kernels_dequantizes(tmp_path):
    hf_model, _ = write_quantized_llama(tmp_path, "awq", 64)
    llm = LLM(model=str(tmp_path), **FLOAT32, kv_cache_memory=8 << 20)
    assert not any(isinstance(m, Int4Linear) for m in llm.llm_engine.model_runner.model.modules())
    prompt = prompts([30])[0]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    assert (prefill_logits(llm.llm_engine, prompt) - ref).abs().max().item() < LOGIT_TOLERANCE


def test_gptq_act_order_loads_only_when_its_groups_are_in_order(tmp_path):
    write_quantized_llama(tmp_path / "ordered", "gptq", 32, desc_act=True)  # g_idx in plain order after all
    assert LLM(model=str(tmp_path / "ordered"), dtype="float32", kv_cache_memory=8 << 20)
    folder = tmp_path / "shuffled"
    write_quantized_llama(folder, "gptq", 32, desc_act=True)
    tensors = load_file(folder / "model.safetensors")
    g_idx = tensors["model.layers.0.mlp.down_proj.g_idx"]
    tensors["model.layers.0.mlp.down_proj.g_idx"] = g_idx[torch.randperm(len(g_idx), generator=torch.Generator()
                                                                          .manual_seed(0))]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="act-order .desc_act: true.*use a checkpoint quantized with desc_act: false"):
        LLM(model=str(folder), dtype="float32", kv_cache_memory=8 << 20)


@pytest.mark.parametrize("change, message", [
    ({"bits": 8}, "8 bits are not supported"), ({"group_size": 16}, "group_size 16 is not supported"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({"zero_point": False}, "without zero points"),
])
def test_unsupported_quantization_configs_are_rejected(tmp_path, change, message):
    write_hf_model(tmp_path, "llama", **SHAPE)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {**quantization_config("awq", 32), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=8 << 20)
