"""AsyncLLM in-process: concurrent streams, aborts that free blocks, engine failures that end only their requests."""
import asyncio
from dataclasses import replace

import pytest

from conftest import num_clear_positions, top2_gap
from inferno import LLMEngine, SamplingParams
from inferno.config import EngineConfig
from inferno.engine.async_llm import AsyncLLM, RequestFailedError

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# A request alone and the same request among others may run different kernels (the engine's first step runs the
# stored blocks, later ones the tiles; a prefill beside decodes): equal in float up to rounding, which the default
# model's int8 activations (re-quantized at every layer) make up to ~0.1 in a logprob (measured on SmolLM2 Q4_1).
LOGPROB_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(max_model_len=256, kv_cache_memory=64 << 20))


def run(engine: LLMEngine, scenario) -> None:
    """Run `scenario(async_llm)` on a fresh event loop with the engine thread started and stopped around it."""
    async def main() -> None:
        async_llm = AsyncLLM(engine)
        async_llm.start()
        try:
            await scenario(async_llm)
        finally:
            await asyncio.to_thread(async_llm.shutdown)
    asyncio.run(main())
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_blocks


async def collect(async_llm: AsyncLLM, prompt: str, request_id: str, params: SamplingParams = GREEDY) -> list[int]:
    return [t async for output in async_llm.generate(prompt, params, request_id) for t in output.outputs[0].token_ids]


async def collect_gaps(async_llm: AsyncLLM, prompt: str, request_id: str) -> tuple[list[int], list[float]]:
    """Greedy tokens and, per token, the gap between the two best logprobs."""
    tokens, gaps = [], []
    async for output in async_llm.generate(prompt, replace(GREEDY, logprobs=2), request_id):
        tokens += output.outputs[0].token_ids
        gaps += [top2_gap(position) for position in output.outputs[0].logprobs]
    return tokens, gaps


def test_concurrent_streams_get_their_own_tokens(engine):
    """Four different prompts at once: each stream carries its own request's tokens, those it gets alone, up to the
    first near-tie (where the two runs' rounding may pick either token)."""
    prompts = ["Count: 1, 2, 3, 4,", "A B C D E F", "The capital of France is", "One two three"]

    async def scenario(async_llm: AsyncLLM) -> None:
        alone = [await collect_gaps(async_llm, prompt, f"alone{i}") for i, prompt in enumerate(prompts)]
        together = await asyncio.gather(*(collect(async_llm, prompt, f"r{i}") for i, prompt in enumerate(prompts)))
        for (tokens, gaps), got in zip(alone, together):
            clear = num_clear_positions(gaps, LOGPROB_TOLERANCE, min_compared=2)
            assert len(got) == 6 and got[:clear] == tokens[:clear]
        assert len({tuple(tokens[:2]) for tokens, _ in alone}) == len(prompts)  # a mix-up would show
    run(engine, scenario)


def test_add_request_error_reaches_the_caller(engine):
    async def scenario(async_llm: AsyncLLM) -> None:
        with pytest.raises(ValueError, match="max_model_len"):
            await async_llm.add_request("long", {"prompt_token_ids": [1] * 300}, GREEDY)
        assert len(await collect(async_llm, "Still serving", "next")) == 6
    run(engine, scenario)


def test_abort_ends_the_stream_and_frees_blocks(engine):
    async def scenario(async_llm: AsyncLLM) -> None:
        stream = await async_llm.add_request("long", "Count with me:", SamplingParams(max_tokens=200, ignore_eos=True))
        await anext(stream)
        async_llm.abort("long")
        assert [output async for output in stream if output.finished] == []
        assert stream.finished
    run(engine, scenario)


def test_leaving_generate_early_aborts(engine):
    async def scenario(async_llm: AsyncLLM) -> None:
        outputs = async_llm.generate("Count with me:", SamplingParams(max_tokens=200, ignore_eos=True), "early")
        await anext(outputs)
        await outputs.aclose()
        await collect(async_llm, "Flush", "after")  # runs after the abort was applied
    run(engine, scenario)


def test_a_failed_model_step_ends_its_requests_and_serving_goes_on(engine, monkeypatch):
    execute_model = engine.model_runner.execute_model
    calls = {"n": 0}

    def fail_once(sched):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected kernel failure")
        return execute_model(sched)

    async def scenario(async_llm: AsyncLLM) -> None:
        with pytest.raises(RequestFailedError, match="injected kernel failure"):
            await collect(async_llm, "Doomed", "doomed")
        assert len(await collect(async_llm, "Survivor", "survivor")) == 6

    monkeypatch.setattr(engine.model_runner, "execute_model", fail_once)
    run(engine, scenario)


def test_a_crashing_engine_step_ends_what_is_in_flight_and_serving_goes_on(engine, monkeypatch):
    step = engine.step
    calls = {"n": 0}

    def crash_once():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected scheduler bug")
        return step()

    async def scenario(async_llm: AsyncLLM) -> None:
        with pytest.raises(RequestFailedError, match="injected scheduler bug"):
            await collect(async_llm, "Doomed", "doomed")
        assert len(await collect(async_llm, "Survivor", "survivor")) == 6

    monkeypatch.setattr(engine, "step", crash_once)
    run(engine, scenario)
