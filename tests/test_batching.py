"""A request's output does not depend on the batch, on chunked prefill or on preemption; blocks never leak."""
import pytest

from conftest import FLOAT32, assert_all_blocks_free
from inferno import LLM, SamplingParams
from inferno.worker.model_runner import kv_bytes_per_block

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    base = tok.encode("A long time ago, in a small village by the sea, there lived an old fisherman who told stories "
                      "about the storms he had seen, the fish he had caught and the friends he had lost. ")
    words = tok.encode(" one two three four five six seven eight nine ten eleven twelve thirteen fourteen")
    return [(base * 3)[: 5 + 17 * i % 120] + words[: i % 7] for i in range(16)]


@pytest.fixture(scope="module")
def alone(llm, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def run_batch(llm: LLM, prompts: list[list[int]], **params) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert_all_blocks_free(llm.llm_engine)
    return [o.outputs[0].token_ids for o in outs]


def test_a_step_runs_prompts_of_mixed_lengths_together(llm, prompts, monkeypatch):
    """The batch is ragged where it matters: one step computes prompts of at least 10 different lengths."""
    scheduled_lengths = []
    schedule = llm.llm_engine.scheduler.schedule

    def recording_schedule():
        sched = schedule()
        scheduled_lengths.append(set(sched.num_scheduled_tokens.values()))
        return sched

    monkeypatch.setattr(llm.llm_engine.scheduler, "schedule", recording_schedule)
    run_batch(llm, prompts)
    assert max(len(lengths) for lengths in scheduled_lengths) >= 10


def test_batch_of_16_matches_alone(llm, prompts, alone):
    assert run_batch(llm, prompts) == alone


def test_chunked_prefill_matches_alone(model_path, prompts, alone):
    small_chunks = LLM(model_path, max_num_batched_tokens=32, kv_cache_memory=256 << 20, **FLOAT32)
    assert run_batch(small_chunks, prompts) == alone


def test_preemption_matches_alone(llm, model_path, prompts, alone):
    block_bytes = kv_bytes_per_block(llm.llm_engine.model_config, 16, llm.llm_engine.config.kv_cache_dtype)
    tiny_cache = LLM(model_path, kv_cache_memory=40 * block_bytes, **FLOAT32)  # 40 blocks for 16 requests of up to 11 blocks
    assert run_batch(tiny_cache, prompts) == alone
    assert tiny_cache.llm_engine.scheduler.num_preemptions > 0


def test_abort_frees_blocks(llm, prompts):
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.num_free_blocks < engine.num_blocks
    engine.abort_request([f"abort-{i}" for i in range(len(prompts))])
    assert_all_blocks_free(engine)
    assert engine.get_num_unfinished_requests() == 0
