"""Tensor and pipeline parallelism on 2 ranks match one process; a dead rank fails the engine fast.

Each test starts (and shuts down) its own 2-rank engine: a process joins one torch.distributed group at a time.
"""
import os
import signal
import subprocess
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import torch
import torch.distributed as dist

from conftest import FLOAT32, assert_same_greedy, num_clear_positions, prefill_logits, top2_gap
from inferno import LLM, SamplingParams
from inferno.distributed.parallel_state import ParallelRank
from inferno.distributed.partition import split_heads
from inferno.executor import ExecutorDeadError
from inferno.layers.quantization.int4 import Int4Linear
from inferno.layers.quantization.q8 import Q8Linear
from inferno.model.llama import LlamaForCausalLM
from test_model_vs_hf import PROMPTS, write_tiny_hf_model
from test_server import RemoteServer

LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2)}
# float32 logits of up to ~30 are sums of 576-1536 products per layer: one process on two correct float32 kernels
# (MKL's sgemm, oneDNN's inner product on a prepacked weight) differs by 1.2e-4 on these prompts, and a rank's partial
# sums over half of K are rounded otherwise as much (relative 1e-5); anything wrong moves logits by far more
LOGIT_TOLERANCE = 3e-4
GGUF_PARAMS = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)


@contextmanager
def parallel_llm(**kwargs):
    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.shutdown()
    assert not dist.is_initialized()


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def check_matches_single_process(single: LLM, model: str | None, layout: str, prompts: list[str],
                                 engine_args: dict = FLOAT32) -> LLM:
    ids = single.get_tokenizer().encode(PROMPTS[0])
    ref_logits = prefill_logits(single.llm_engine, ids)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
    reference = single.generate(prompts, params, use_tqdm=False)
    with parallel_llm(model=model, kv_cache_memory=16 << 20, **LAYOUTS[layout], **engine_args) as llm:
        assert llm.llm_engine.num_blocks == single.llm_engine.num_blocks
        logits = prefill_logits(llm.llm_engine, ids)
        assert (logits - ref_logits).abs().max().item() < LOGIT_TOLERANCE
        assert_same_greedy(reference, llm.generate(prompts, params, use_tqdm=False), LOGIT_TOLERANCE, min_compared=8)
        if layout == "tp2":
            single_bytes = param_bytes(single.llm_engine.model_runner.model)
            rank0 = param_bytes(llm.llm_engine.model_runner.model)
            with torch.device("meta"):  # rank 1's shard, built the way rank 1 builds it
                rank1 = param_bytes(LlamaForCausalLM(single.llm_engine.model_config, ParallelRank(1, 2, 1)))
            assert 0.4 < rank0 / single_bytes < 0.6 and 0.4 < rank1 / single_bytes < 0.6
            assert rank0 + rank1 < 1.01 * single_bytes  # only the norms are replicated
        assert not llm.llm_engine.has_unfinished_requests()
        assert llm.llm_engine.num_free_blocks == llm.llm_engine.num_blocks


@pytest.mark.parametrize("layout", LAYOUTS)
def test_default_model_matches_single_process(layout):
    # SmolLM2: 9 query heads over 3 KV heads, split 1 + 2 KV heads with 2 ranks
    single = LLM(kv_cache_memory=16 << 20, **FLOAT32)
    check_matches_single_process(single, None, layout, [PROMPTS[0], PROMPTS[2], "Hello, my name is"])


@pytest.fixture(scope="module")
def gguf_reference():
    """One process on the defaults (the GGUF's blocks as stored, activations quantized to int8 per block of 32), on
    its tiles (from its second step on): a prompt's logprobs over the whole vocabulary, greedy continuations."""
    single = LLM(kv_cache_memory=16 << 20)
    prompts = [PROMPTS[0], PROMPTS[2], "Hello, my name is"]
    single.generate(prompts[:1], SamplingParams(max_tokens=3), use_tqdm=False)
    ids = single.get_tokenizer().encode(PROMPTS[0])
    logprobs = prefill_logits(single.llm_engine, ids).log_softmax(-1)
    return ids, logprobs, prompts, single.generate(prompts, GGUF_PARAMS, use_tqdm=False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gguf_as_stored_matches_single_process(gguf_reference, layout):
    """The defaults split over 2 ranks compute one process's bits. Their int8 activations turn any last-bit
    difference into up to a logit (a relative 1e-7 on the embeddings moves logprobs by 0.2), so "close" is not
    enough: tensor-parallel ranks compute whole outputs of every layer (row-parallel ones on the gathered input,
    `GatheredRowParallel`), pipeline stages whole layers. Greedy tokens are compared under tensor parallelism only:
    pipeline stages run micro-batches, and on this path even one process's tokens depend on how requests are
    batched (see docs/parallelism.md)."""
    ids, ref_logprobs, prompts, reference = gguf_reference
    with parallel_llm(kv_cache_memory=16 << 20, **LAYOUTS[layout]) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=3), use_tqdm=False)  # every rank on its tiles
        logprobs = prefill_logits(llm.llm_engine, ids).log_softmax(-1)
        assert (logprobs - ref_logprobs).abs().max().item() < LOGIT_TOLERANCE
        if layout == "tp2":
            outputs = llm.generate(prompts, GGUF_PARAMS, use_tqdm=False)
            assert_same_greedy(reference, outputs, LOGIT_TOLERANCE, min_compared=8)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_qwen2_model_matches_single_process(llm, tmp_path, layout):
    write_tiny_hf_model(tmp_path, llm.get_tokenizer(), "qwen2")
    single = LLM(model=str(tmp_path), kv_cache_memory=16 << 20, **FLOAT32)
    check_matches_single_process(single, str(tmp_path), layout, [PROMPTS[0], PROMPTS[2]])


def test_pipeline_micro_batches_match_one_batch():
    """With pipeline parallelism a step's requests are split into micro-batches, and a request alone has its prompt
    cut into one piece per stage; outputs must not change."""
    prompts = [PROMPTS[0], PROMPTS[2], "Hello, my name is", "The best way to learn"]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    with parallel_llm(kv_cache_memory=16 << 20, pipeline_parallel_size=2, **FLOAT32) as llm:
        one_by_one = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]  # prompts cut in two pieces
        batched = llm.generate(prompts, params, use_tqdm=False)  # two micro-batches of whole requests
    assert_same_greedy(one_by_one, batched, LOGIT_TOLERANCE, min_compared=4)
    for alone, together in zip(one_by_one, batched):
        assert len(alone.prompt_logprobs) == len(together.prompt_logprobs) == len(alone.prompt_token_ids)
        for a, b in zip(alone.prompt_logprobs[1:], together.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < LOGIT_TOLERANCE for t in a)


def test_ngram_speculation_with_pipeline_parallelism_matches_plain_decoding(llm):
    """Drafts are proposed and verified on rank 0 from the last stage's logits: greedy tokens as without
    speculation, alone (a step with drafts is not cut into pieces) and batched."""
    story = "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat on the"
    prompts = [story, PROMPTS[0]]
    reference = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True),
                             use_tqdm=False)
    clear = [num_clear_positions([top2_gap(step) for step in ref.outputs[0].logprobs], LOGIT_TOLERANCE, min_compared)
             for ref, min_compared in zip(reference, (8, 1))]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with parallel_llm(kv_cache_memory=16 << 20, pipeline_parallel_size=2, speculative_config=spec,
                      **FLOAT32) as spec_llm:
        alone = spec_llm.generate(story, params, use_tqdm=False)
        batched = spec_llm.generate(prompts, params, use_tqdm=False)
        assert spec_llm.llm_engine.spec_decoding_stats.num_accepted_tokens > 0
        assert spec_llm.llm_engine.num_free_blocks == spec_llm.llm_engine.num_blocks
    for ref, out, n in zip(reference, alone, clear):
        assert out.outputs[0].token_ids[:n] == ref.outputs[0].token_ids[:n]
    for ref, out, n in zip(reference, batched, clear):
        assert out.outputs[0].token_ids[:n] == ref.outputs[0].token_ids[:n]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_draft_model_speculation_with_parallelism_matches_plain_decoding(llm, model_path, layout):
    """The target split over 2 ranks, the draft (the default model as its own draft) whole on rank 0: greedy tokens
    as one process gives without speculation, alone and batched, with drafts accepted and no block leaked."""
    prompts = ["The cat sat on the mat. The dog sat on the log. The cat sat on the", PROMPTS[0]]
    reference = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True),
                             use_tqdm=False)
    clear = [num_clear_positions([top2_gap(step) for step in ref.outputs[0].logprobs], LOGIT_TOLERANCE, min_compared)
             for ref, min_compared in zip(reference, (8, 1))]
    spec = {"method": "draft_model", "model": model_path, "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with parallel_llm(kv_cache_memory=16 << 20, speculative_config=spec, **LAYOUTS[layout], **FLOAT32) as spec_llm:
        engine = spec_llm.llm_engine
        draft = engine.executor.worker.proposer.runner.model
        assert param_bytes(draft) == param_bytes(llm.llm_engine.model_runner.model)  # not split
        alone = spec_llm.generate(prompts[0], params, use_tqdm=False)
        batched = spec_llm.generate(prompts, params, use_tqdm=False)
        assert engine.spec_decoding_stats.num_accepted_tokens > 0
        assert engine.num_free_blocks == engine.num_blocks
    for ref, out, n in zip(reference, alone, clear):
        assert out.outputs[0].token_ids[:n] == ref.outputs[0].token_ids[:n]
    for ref, out, n in zip(reference, batched, clear):
        assert out.outputs[0].token_ids[:n] == ref.outputs[0].token_ids[:n]


def test_pipeline_with_int4_weights_and_int8_kv_cache_matches_one_process():
    """Each stage loads and quantizes only its own layers, with its layers' KV cache in int8."""
    quantized = dict(quantization="int4", kv_cache_dtype="int8", kv_cache_memory=16 << 20)
    single = LLM(**quantized, enforce_eager=True)  # eager, as the stages' steps
    single.wait_for_warm_up()  # its int4 weights tiled, as the stages' will be
    prompts = [PROMPTS[0], "Hello, my name is"]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    reference = single.generate(prompts, params, use_tqdm=False)
    with parallel_llm(pipeline_parallel_size=2, **quantized) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # starts every rank's warm-up
        llm.wait_for_warm_up()  # this rank's tiles; the other rank tiles its half alike
        model = llm.llm_engine.model_runner.model
        assert llm.llm_engine.num_blocks == single.llm_engine.num_blocks
        assert isinstance(model.lm_head, Q8Linear)
        assert all(isinstance(model.layers[i].mlp.down_proj, Int4Linear) for i in model.stage_layers)
        assert len(model.stage_layers) < single.llm_engine.model_config.num_hidden_layers
        assert all(a.k_cache.dtype == torch.int8 and a.k_scale is not None for a in model.attention_layers)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    # bfloat16 activations: the same kernels on other thread counts may round differently in the last bits
    for ref, out in zip(reference, outputs):
        ref, out = ref.outputs[0], out.outputs[0]
        clear = next((i for i, step in enumerate(ref.logprobs) if top2_gap(step) < 0.05), len(ref.logprobs))
        assert clear >= 3, "reference has an early near-tie; pick another prompt"
        assert out.token_ids[:clear] == ref.token_ids[:clear]


def test_killed_worker_fails_the_engine_fast():
    with parallel_llm(kv_cache_memory=16 << 20, tensor_parallel_size=2) as llm:
        worker = llm.llm_engine.executor.processes[0]
        killer = threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(ExecutorDeadError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            llm.generate(["Once upon a time"] * 4, SamplingParams(max_tokens=4000, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - start < 1.0 + 5.0
        assert not llm.llm_engine.is_healthy()
        assert worker.exitcode == -signal.SIGKILL
        assert not dist.is_initialized()  # the executor left its process group already
        with pytest.raises(ExecutorDeadError):
            llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)


def spawned_ranks(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(c) for c in children if "spawn_main" in open(f"/proc/{c}/cmdline").read()
            and "resource_tracker" not in open(f"/proc/{c}/cmdline").read()]


def test_server_reports_unhealthy_when_a_rank_dies():
    server = RemoteServer("--pipeline-parallel-size", "2", "--kv-cache-memory", str(16 << 20))
    try:
        reply = server.client().completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="Hello", max_tokens=4)
        assert reply.choices[0].text
        [worker] = spawned_ranks(server.process.pid)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while httpx.get(f"{server.url}/health").status_code == 200:
            assert time.monotonic() < deadline, "still healthy 5 s after a rank died"
            time.sleep(0.1)
        assert httpx.get(f"{server.url}/health").status_code == 500
        with pytest.raises(Exception):
            server.client().completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="Hello", max_tokens=4)
    finally:
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=30) == 0, server.output()
        server.log.close()


@pytest.mark.parametrize("num_heads, num_kv_heads, tp_size", [(9, 3, 2), (9, 3, 3), (4, 2, 2), (8, 2, 4), (8, 1, 8)])
def test_every_query_head_lands_on_one_rank_with_its_kv_head(num_heads, num_kv_heads, tp_size):
    splits = [split_heads(num_heads, num_kv_heads, tp_size, rank) for rank in range(tp_size)]
    assert sorted(h for s in splits for h in s.q_heads) == list(range(num_heads))
    group = num_heads // num_kv_heads
    for s in splits:
        assert {h // group for h in s.q_heads} == set(s.kv_heads)
        assert len(s.q_heads) == len(s.kv_heads) * group or len(s.kv_heads) == 1


def test_heads_that_cannot_split_are_a_clear_error():
    with pytest.raises(ValueError, match="tensor_parallel_size=4 cannot split 9 query heads over 3 KV heads"):
        split_heads(9, 3, 4, 0)


def test_pipeline_stages_cover_every_layer_once():
    stages = [ParallelRank(rank, 1, 3).stage_layers(30) for rank in range(3)]
    assert [layer for stage in stages for layer in stage] == list(range(30))
    assert [len(ParallelRank(rank, 1, 4).stage_layers(30)) for rank in range(4)] == [7, 7, 8, 8]
    with pytest.raises(ValueError, match="larger than the model's 2 layers"):
        ParallelRank(0, 1, 4).stage_layers(2)
