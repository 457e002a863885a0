"""The torch.compile'd decode step computes what the eager one does, at batch 1 and with dynamic batch sizes; it is
compiled in the background and the engine switches to it between steps without changing a token. A tiny random llama
stands in for the default model: compiling the default model's 30 layers costs minutes, and the graphs are the same
per layer."""
import logging
import re
import threading
from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import assert_all_blocks_free
from inferno import LLM, SamplingParams
from inferno.cpu_features import cpu_flags
from inferno.layers.quantization.int4 import Int4Linear
from inferno.layers.quantization.q8 import Q8Linear
from inferno.layers.quantization.super_blocks import SuperBlockLinear
from inferno.sampling_params import RequestOutputKind
from inferno.worker import warm_up
from inferno.worker.compiled_decode import vector_width_option
from inferno.worker.warm_up import WarmUp
from native_kernels import needs_kernels
from tiny_gguf import T, write_tiny_gguf
from tiny_models import write_hf_model

pytestmark = needs_kernels

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three facts about the Moon:\n1."]
PARAMS = SamplingParams(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    write_hf_model(folder, "llama", num_hidden_layers=4)
    return str(folder)


def generate(llm: LLM, prompts: list[str]):
    return [o.outputs[0] for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def assert_identical(ref, out) -> None:
    """The same tokens and log-probabilities, bit for bit: the compiled step calls the eager step's kernels, the
    fused elementwise ones included (layers/fused_cpu.py), so even int8 activations (re-quantized at every layer,
    where a last-bit difference can move a code) come out the same."""
    assert out.token_ids == ref.token_ids
    assert [{t: lp.logprob for t, lp in p.items()} for p in out.logprobs] == \
        [{t: lp.logprob for t, lp in p.items()} for p in ref.logprobs]


@pytest.mark.parametrize("engine_args", [{"dtype": "float32", "quantization": None},
                                         {"quantization": "int4", "dtype": "bfloat16"}])
def test_compiled_decode_matches_eager(model, engine_args):
    eager = LLM(model, kv_cache_memory=16 << 20, enable_prefix_caching=False, enforce_eager=True, **engine_args)
    compiled = LLM(model, kv_cache_memory=16 << 20, enable_prefix_caching=False, enforce_eager=False, **engine_args)
    assert not eager.llm_engine.model_runner.wait_for_warm_up()
    runner = compiled.llm_engine.model_runner
    assert runner.wait_for_warm_up()
    # the warm-up wrote K/V into the scratch block only, outside the pool
    assert runner.scratch_block == compiled.llm_engine.num_blocks
    for attn in runner.model.attention_layers:
        assert not attn.k_cache[:, :runner.scratch_block].any() and attn.k_cache[:, runner.scratch_block].any()
    graphs = counters["stats"]["unique_graphs"]  # compiled by the warm-up: one request, and any batch
    steps = runner.compiled_decode
    for prompts in (PROMPTS[:1], PROMPTS):  # batch 1 (a specialised graph), then a dynamic batch size
        before = steps.num_compiled_steps
        for ref, out in zip(generate(eager, prompts), generate(compiled, prompts)):
            assert_identical(ref, out)
        assert steps.num_compiled_steps >= before + PARAMS.max_tokens - 1  # every decode step ran compiled
    assert steps.num_eager_steps == 0
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation for other batch sizes or table widths


@needs_kernels
@pytest.mark.parametrize("qtype, layer_type", [(T.Q4_K, SuperBlockLinear), (T.Q4_1, Int4Linear),
                                               (T.Q8_0, Q8Linear)])
def test_compiled_decode_runs_the_tiles_the_warm_up_made(tmp_path, qtype, layer_type):
    """A GGUF of Q4_K (Q4_1, Q8_0) weights: the runner regroups them into tiles before the warm-up compiles, so the
    compiled decode step calls the tiles' kernel; its tokens are the eager engine's (on the tiles too), at batch 1 and
    batched. Int4 and Q8 weights' codes stay in memory for `dequantize`: zeroed here, they must change no token."""
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", qtype, tied=False))
    eager = LLM(path, kv_cache_memory=16 << 20, enable_prefix_caching=False, enforce_eager=True)
    compiled = LLM(path, kv_cache_memory=16 << 20, enable_prefix_caching=False, enforce_eager=False)
    assert not eager.llm_engine.model_runner.wait_for_warm_up()
    assert compiled.llm_engine.model_runner.wait_for_warm_up()
    for llm in (eager, compiled):
        layers = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, layer_type) and m.can_tile]
        assert len(layers) >= 8 and all(m.tiles is not None for m in layers)  # 2 layers' projections at least
        if layer_type in (Int4Linear, Q8Linear):
            for m in layers:
                m.weight.zero_()
    for prompts in (PROMPTS[:1], PROMPTS):
        for ref, out in zip(generate(eager, prompts), generate(compiled, prompts)):
            assert_identical(ref, out)


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="an x86 CPU with AVX2")
def test_the_compile_options_name_the_vector_width_that_the_cache_key_lacks(monkeypatch):
    """Inductor picks 256-bit vectors under ATEN_CPU_CAPABILITY=avx2 and the CPU's widest otherwise, but its compile
    cache does not key on that choice: the options name it, so the two never share a compiled graph."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert vector_width_option() == {"cpp.simdlen": 256}
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert vector_width_option() == {"cpp.simdlen": 512 if "avx512f" in cpu_flags() else 256}


def test_a_draft_model_s_runner_and_the_target_s_both_compile_and_are_waited_for(model, monkeypatch):
    """A draft model's runner has a warm-up of its own beside the target's: both compile their decode step (one after
    the other: two traces at once broke the second), the draft's passes are its runner's steps (its warm-up waited
    its full second for a first step that never came), and `wait_for_warm_up` returns once both are over."""
    monkeypatch.setattr(warm_up, "read_precompiled", lambda path: None)  # traced, though an earlier test saved them
    llm = LLM(model, kv_cache_memory=16 << 20, dtype="float32", enforce_eager=False,
              speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 2})
    draft = llm.llm_engine.executor.worker.proposer.runner
    assert not draft.warm_up._first_step_done.is_set()
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    # the draft's passes are its runner's steps: its warm-up waits for the first
    assert draft.warm_up._first_step_done.is_set()
    assert llm.wait_for_warm_up()
    assert not draft.warm_up._thread.is_alive() and draft.compiled_decode is not None


def test_a_draft_model_of_other_shapes_gets_symbols_only_for_the_step_s_inputs(model, tmp_path, monkeypatch):
    """`decode_step` is one function for the target and its draft: with dynamo's automatic dynamic shapes the draft's
    trace, after the target's, took every size that differed between the two (its KV caches' among them) as a
    symbol (Qwen2.5-Coder-1.5B with its 0.5B as draft: the draft traced twice, 25-31 s each instead of 4-7). Only the
    batch size and the block-table width are symbols, in both models' graphs."""
    draft = tmp_path / "draft"
    write_hf_model(draft, "llama", num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2)
    monkeypatch.setattr(warm_up, "read_precompiled", lambda path: None)  # traced, though an earlier test saved them
    symbols = []

    class Symbols(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if (found := re.search(r"create_symbol \w+ = \d+ for (L\['\w+'\])", record.getMessage())):
                symbols.append(found.group(1))

    handler, shapes_log = Symbols(), logging.getLogger("torch.fx.experimental.symbolic_shapes")
    torch._logging.set_logs(dynamic=logging.INFO)
    shapes_log.addHandler(handler)
    try:
        llm = LLM(model, kv_cache_memory=16 << 20, dtype="float32", enforce_eager=False,
                  speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
        assert llm.wait_for_warm_up()
    finally:
        shapes_log.removeHandler(handler)
        torch._logging.set_logs()
    assert llm.llm_engine.executor.worker.proposer.runner.compiled_decode is not None
    assert symbols.count("L['input_ids']") == 2  # the batch graphs of both models
    assert set(symbols) == {"L['input_ids']", "L['positions']", "L['slot_mapping']", "L['block_tables']",
                            "L['seq_lens']"}


def test_switch_from_eager_to_compiled_mid_serving_changes_no_token(model, monkeypatch):
    """Requests start while the decode step is still compiling (held back here), run eagerly, and finish on the
    compiled step once it is handed over: the same tokens as all-eager, no block leaked, nothing compiled twice."""
    release = threading.Event()
    compile_decode_step = WarmUp._compile_decode_step
    monkeypatch.setattr(WarmUp, "_compile_decode_step",
                        lambda self: (release.wait(), compile_decode_step(self)))
    # int4 weights: their kernels quantize each layer's input to int8 (as the default model's do)
    eager = LLM(model, kv_cache_memory=16 << 20, dtype="float32", quantization="int4", enforce_eager=True)
    llm = LLM(model, kv_cache_memory=16 << 20, dtype="float32", quantization="int4", enforce_eager=False)
    engine, runner = llm.llm_engine, llm.llm_engine.model_runner
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, replace(PARAMS, output_kind=RequestOutputKind.FINAL_ONLY))
    finished = {}
    for _ in range(8):  # prefill and some eager decode steps
        finished.update((o.request_id, o) for o in engine.step())
    assert runner.compiled_decode is None and not finished
    release.set()
    assert runner.wait_for_warm_up()
    graphs = counters["stats"]["unique_graphs"]
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step())
    assert counters["stats"]["unique_graphs"] == graphs
    for i, ref in enumerate(generate(eager, PROMPTS)):
        assert_identical(ref, finished[str(i)].outputs[0])
    assert_all_blocks_free(engine)


def test_steps_run_on_one_thread_fewer_while_the_decode_step_compiles_and_get_the_same_bits(model, monkeypatch):
    """While the warm-up compiles (held back here), the serving thread's steps run on one thread fewer, leaving the
    compile a core; once the compiled step is handed over, on all of them. A long prompt's decode attention is split
    for the engine's threads, not the step's, so the tokens are all-eager's, on one thread and on two."""
    compiling, release = threading.Event(), threading.Event()
    compile_and_warm_up = WarmUp._compile_and_warm_up
    monkeypatch.setattr(WarmUp, "_compile_and_warm_up",
                        lambda self: (compiling.set(), release.wait(), compile_and_warm_up(self))[2])
    monkeypatch.setattr(warm_up, "read_precompiled", lambda path: None)  # compiled, though an earlier test saved it
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        eager = LLM(model, kv_cache_memory=16 << 20, dtype="float32", enforce_eager=True)
        llm = LLM(model, kv_cache_memory=16 << 20, dtype="float32", enforce_eager=False)
        runner, threads = llm.llm_engine.model_runner, []
        forward = runner.forward
        monkeypatch.setattr(runner, "forward",
                            lambda *args: (threads.append(torch.get_num_threads()), forward(*args))[1])
        prompt = {"prompt_token_ids": [3 + i % 50 for i in range(300)]}  # 2 splits of its keys on 2 threads
        [ref] = [o.outputs[0] for o in eager.generate([prompt], PARAMS, use_tqdm=False)]
        assert compiling.wait(timeout=300)
        [while_compiling] = [o.outputs[0] for o in llm.generate([prompt], PARAMS, use_tqdm=False)]
        assert runner.compiled_decode is None and set(threads) == {1}
        release.set()
        assert runner.wait_for_warm_up()
        threads.clear()
        [compiled] = [o.outputs[0] for o in llm.generate([prompt], PARAMS, use_tqdm=False)]
        assert set(threads) == {2} and runner.compiled_decode.num_compiled_steps >= PARAMS.max_tokens - 1
    finally:
        release.set()
        torch.set_num_threads(previous)
    assert_identical(ref, while_compiling)
    assert_identical(ref, compiled)


def test_fx_tracing_on_the_compile_thread_leaves_other_threads_modules_alone():
    """FX patches torch.nn.Module.__call__ for the whole process while it traces; within the compile's context a
    module called on another thread (the serving thread's eager step) runs as usual, while the tracing thread's
    calls go through the tracer's patch."""
    from torch.fx._symbolic_trace import _Patcher
    from inferno.worker.compiled_decode import fx_patches_on_this_thread_only

    def traced_call(module, *args, **kwargs):
        raise RuntimeError("called through the tracer's patch")

    layer, x, results = torch.nn.Linear(4, 4), torch.ones(1, 4), []
    with fx_patches_on_this_thread_only():
        patcher = _Patcher()
        patcher.patch_method(torch.nn.Module, "__call__", traced_call, deduplicate=False)
        try:
            other = threading.Thread(target=lambda: results.append(layer(x)))
            other.start()
            other.join()
            with pytest.raises(RuntimeError, match="tracer's patch"):
                layer(x)
        finally:
            patcher.revert_all_patches()
    assert len(results) == 1 and torch.equal(results[0], layer(x))
