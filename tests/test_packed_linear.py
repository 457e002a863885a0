"""bfloat16 linear layers on oneDNN's prepacked weights (layers/packed_linear.py): the same bits as `F.linear`,
traceable by torch.compile, made by the runner's TileSwitch before the first pass."""
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_all_blocks_free
from inferno import LLM, SamplingParams
from inferno.layers import packed_linear
from inferno.layers.fused_cpu import resolve_fused_ops
from inferno.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from tiny_models import write_hf_model

pytestmark = pytest.mark.skipif(not packed_linear.packable(torch.zeros(2, 2, dtype=torch.bfloat16)),
                                reason="oneDNN has no bfloat16 inner product on this CPU")


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_weight_gives_f_linear_bits(rows, with_bias):
    torch.manual_seed(rows)
    weight = torch.randn(272, 96, dtype=torch.bfloat16)
    bias = torch.randn(272, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    expected = F.linear(x, weight, bias)
    assert not packed_linear.is_packed(weight)
    packed_linear.pack(weight)
    assert packed_linear.is_packed(weight)
    assert torch.equal(packed_linear.linear(x, weight, bias), expected)
    resolve_fused_ops()  # as a compile does before it traces a model
    compiled = torch.compile(packed_linear.linear, dynamic=True, fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(compiled(x, weight, bias), expected)


def test_a_copy_lives_as_long_as_its_weight():
    kept = torch.randn(32, 64, dtype=torch.bfloat16)
    packed_linear.pack(kept)
    assert torch.ops.inferno.drop_packed_linear_weight(kept.data_ptr())  # a copy there: the check below can fail
    weight = torch.randn(32, 64, dtype=torch.bfloat16)
    packed_linear.pack(weight)
    address = weight.data_ptr()
    del weight  # its copy goes with it: a later tensor at that address must not find a stale copy
    assert not torch.ops.inferno.drop_packed_linear_weight(address)


def test_training_keeps_autograd():
    weight = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    packed_linear.linear(x, weight).float().sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("packed") / "llama"
    write_hf_model(folder, "llama")
    return folder


def greedy_logprobs(llm: LLM) -> list[list[float]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [3 + i, 50, 7 * i + 1, 99, 42]} for i in range(3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]


def test_engine_packs_bf16_weights_and_keeps_its_tokens(bf16_folder, monkeypatch):
    engine_args = dict(dtype="bfloat16", kv_cache_memory=16 << 20, enable_prefix_caching=False, enforce_eager=True)
    packed = LLM(str(bf16_folder), **engine_args)
    with_copies = greedy_logprobs(packed)
    model = packed.llm_engine.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert layers and all(packed_linear.is_packed(m.weight) for m in layers)
    assert_all_blocks_free(packed.llm_engine)
    del packed, model, layers
    monkeypatch.setattr(packed_linear, "packable", lambda weight: False)
    plain = LLM(str(bf16_folder), **engine_args)
    assert greedy_logprobs(plain) == with_copies


def test_compiled_step_keeps_the_eager_bits(bf16_folder):
    engine_args = dict(dtype="bfloat16", kv_cache_memory=16 << 20, enable_prefix_caching=False)
    eager = greedy_logprobs(LLM(str(bf16_folder), enforce_eager=True, **engine_args))
    llm = LLM(str(bf16_folder), enforce_eager=False, **engine_args)
    assert llm.wait_for_warm_up(timeout=600), "the decode step did not compile"
    assert greedy_logprobs(llm) == eager
