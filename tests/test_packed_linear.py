"""Linear layers on oneDNN's prepacked weights (layers/packed_linear.py): bfloat16 with the same bits as `F.linear`,
float32 equal to it up to rounding (oneDNN's kernel where F.linear calls MKL's), traceable by torch.compile, made by
the runner when it is built, before the first pass."""
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_all_blocks_free, assert_same_greedy
from inferno import LLM, RequestOutput, SamplingParams
from inferno.layers import packed_linear
from inferno.layers.fused_cpu import resolve_fused_ops
from inferno.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from tiny_models import write_hf_model

BF16 = pytest.mark.skipif(not packed_linear.packable(torch.zeros(2, 2, dtype=torch.bfloat16)),
                          reason="oneDNN has no bfloat16 inner product on this CPU")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=BF16)]
pytestmark = pytest.mark.skipif(not packed_linear.packable(torch.zeros(2, 2)), reason="no oneDNN or native kernels")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_weight_gives_f_linear_result(dtype, rows, with_bias):
    torch.manual_seed(rows)
    weight = torch.randn(272, 96, dtype=dtype)
    bias = torch.randn(272, dtype=dtype) if with_bias else None
    x = torch.randn(rows, 96, dtype=dtype)
    expected = F.linear(x, weight, bias)
    assert not packed_linear.is_packed(weight)
    packed_linear.pack(weight)
    assert packed_linear.is_packed(weight)
    out = packed_linear.linear(x, weight, bias)
    if dtype == torch.bfloat16:
        assert torch.equal(out, expected)  # F.linear runs the same oneDNN kernel, on the plain weight
    else:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # MKL's kernel there: rounding apart
    resolve_fused_ops()  # as a compile does before it traces a model
    compiled = torch.compile(packed_linear.linear, dynamic=True, fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(compiled(x, weight, bias), out)


def test_a_copy_lives_as_long_as_its_weight():
    kept = torch.randn(32, 64)
    packed_linear.pack(kept)
    assert torch.ops.inferno.drop_packed_linear_weight(kept.data_ptr())  # a copy there: the check below can fail
    weight = torch.randn(32, 64)
    packed_linear.pack(weight)
    address = weight.data_ptr()
    del weight  # its copy goes with it: a later tensor at that address must not find a stale copy
    assert not torch.ops.inferno.drop_packed_linear_weight(address)


@pytest.mark.parametrize("dtype", DTYPES)
def test_training_keeps_autograd(dtype):
    weight = torch.randn(16, 32, dtype=dtype, requires_grad=True)
    x = torch.randn(4, 32, dtype=dtype)
    packed_linear.linear(x, weight).float().sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("packed") / "llama"
    write_hf_model(folder, "llama")
    return folder


def greedy(llm: LLM) -> list[RequestOutput]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [3 + i, 50, 7 * i + 1, 99, 42]} for i in range(3)]
    return llm.generate(prompts, params, use_tqdm=False)


def steps(outputs: list[RequestOutput]) -> list[list[tuple[int, dict[int, float]]]]:
    """Per prompt, per step: the greedy token and the two best log-probabilities (to compare bit for bit)."""
    return [[(t, {k: v.logprob for k, v in lp.items()}) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            for o in outputs]


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=BF16)])
def test_engine_packs_float_weights_and_keeps_its_tokens(hf_folder, dtype, monkeypatch):
    engine_args = dict(dtype=dtype, kv_cache_memory=16 << 20, enable_prefix_caching=False, enforce_eager=True)
    packed = LLM(str(hf_folder), **engine_args)
    with_copies = greedy(packed)
    model = packed.llm_engine.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert layers and all(packed_linear.is_packed(m.weight) for m in layers)
    assert_all_blocks_free(packed.llm_engine)
    del packed, model, layers
    monkeypatch.setattr(packed_linear, "packable", lambda weight: False)
    plain = greedy(LLM(str(hf_folder), **engine_args))
    if dtype == "bfloat16":
        assert steps(plain) == steps(with_copies)  # the same kernel: the same bits
    else:
        assert_same_greedy(plain, with_copies, 1e-4, min_compared=4)  # oneDNN's float32 kernel where MKL's ran


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=BF16)])
def test_compiled_step_keeps_the_eager_bits(hf_folder, dtype):
    engine_args = dict(dtype=dtype, kv_cache_memory=16 << 20, enable_prefix_caching=False)
    eager = steps(greedy(LLM(str(hf_folder), enforce_eager=True, **engine_args)))
    llm = LLM(str(hf_folder), enforce_eager=False, **engine_args)
    assert llm.wait_for_warm_up(timeout=600), "the decode step did not compile"
    assert steps(greedy(llm)) == eager
