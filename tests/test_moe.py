"""Mixture of experts: a decode step runs only the experts the router chose; quantized experts stay close to float."""
import pytest
import torch

from inferno import LLM, SamplingParams
from inferno.layers.moe import SparseMoE, route
from inferno.layers.quantization.swap import quantize_linears
from conftest import FLOAT32, prefill_logits
from tiny_models import write_hf_model
from test_architectures import prompts, tiny_llm

# max |output difference| of one MoE block with quantized experts (groups of 32) against float, relative to the
# largest float output (the router stays float, so both run the same experts)
QUANTIZED_TOLERANCE = {"int8": 0.01, "int4": 0.1}


@pytest.fixture(scope="module")
def olmoe_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("olmoe")
    write_hf_model(path, "olmoe")
    return path


def test_decode_step_runs_only_the_chosen_experts(olmoe_path):
    llm = tiny_llm(olmoe_path)
    moe_layers = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, SparseMoE)]
    chosen, ran = [], []
    for layer in moe_layers:
        layer.gate.register_forward_hook(lambda gate, args, logits, layer=layer: chosen.append(
            set(route(logits, layer.top_k, layer.norm_topk_prob)[1].flatten().tolist())))
        for e, expert in enumerate(layer.experts):
            expert.register_forward_hook(lambda expert, args, out, e=e: ran[-1].add(e) if ran else None)
        layer.gate.register_forward_hook(lambda gate, args, logits: ran.append(set()))
    engine = llm.llm_engine
    engine.add_request("one", {"prompt_token_ids": prompts([20])[0]},
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()  # the prompt
    chosen.clear(), ran.clear()
    engine.step()  # one decode token
    assert len(ran) == len(moe_layers) == 2
    assert ran == chosen and all(len(experts) == 2 for experts in ran)
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_experts_stay_close_to_float(olmoe_path, quantization):
    moe = tiny_llm(olmoe_path).llm_engine.model_runner.model.layers[0].mlp
    x = torch.randn(16, moe.gate.weight.shape[1])
    with torch.inference_mode():
        ref = moe(x)
        quantize_linears(moe, quantization, 32)
        assert all(not isinstance(m, torch.nn.Linear) for e in moe.experts for m in e.children())
        out = moe(x)
    assert (out - ref).abs().max() < QUANTIZED_TOLERANCE[quantization] * ref.abs().max()


def test_int4_moe_model_runs_end_to_end_and_picks_the_float_first_token(olmoe_path):
    """The whole model with int4 experts (and attention), end to end: its first token is float's."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ids = prompts([30])[0]
    quantized = LLM(model=str(olmoe_path), dtype="float32", quantization="int4", kv_cache_memory=8 << 20)
    ref = tiny_llm(olmoe_path).generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert quantized.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids == ref


def test_tensor_parallelism_splits_each_experts_inner_dimension(tmp_path):
    """qwen2_moe over 2 ranks: routed and shared experts split like dense MLPs, one all-reduce per block."""
    write_hf_model(tmp_path, "qwen2_moe")
    ids = prompts([60])[0]
    ref = prefill_logits(tiny_llm(tmp_path).llm_engine, ids)
    llm = LLM(model=str(tmp_path), **FLOAT32, kv_cache_memory=8 << 20,
              tensor_parallel_size=2)
    try:
        expert = llm.llm_engine.model_runner.model.layers[0].mlp.experts[0]
        assert expert.down_proj.weight.shape == (64, 16)  # half of the inner 32 on this rank
        assert (prefill_logits(llm.llm_engine, ids) - ref).abs().max().item() < 1e-4
    finally:
        llm.llm_engine.shutdown()
