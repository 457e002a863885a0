"""Disaggregated prefill and decode: `inferno proxy` in front of a prefill and a decode instance (live servers on
127.0.0.1), compared with a single colocated instance of the same model, through the official openai client."""
import asyncio
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from conftest import assert_all_blocks_free
from inferno.config import EngineConfig
from inferno.core.kv_transfer import KVTransferParams
from inferno.engine.llm_engine import LLMEngine
from inferno.sampling_params import SamplingParams
from test_server import RemoteServer

MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"
# float32 weights and activations: the tests compare one instance with two token for token, and the int4 kernels'
# int8 activations (prompts of a few rows) against the float GEMM of dequantized weights (batched prompts: the
# crossover depends on the CPU) move this model's near-tied greedy tokens (margins of 0.2 flip); so does bfloat16,
# dtype "auto" on CPUs with AVX512-BF16. The transfer itself moves the KV bytes unchanged.
COMMON = ("--max-model-len", "512", "--kv-cache-memory", str(64 << 20), "--num-threads", "1", "--dtype", "float32",
          "--quantization", "none")
PROMPTS = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(8)]
LONG_PROMPT = "You are a helpful assistant who answers questions about the sea and the weather. " * 6
COMPUTED = "inferno:prompt_tokens_computed_total"
BYTES = "inferno:kv_transfer_bytes_total"
FAILURES = "inferno:kv_transfer_failures_total"


@pytest.fixture(scope="module")
def single():
    server = RemoteServer(*COMMON)
    yield server
    server.close()


@pytest.fixture(scope="module")
def prefill():
    server = RemoteServer(*COMMON, "--kv-role", "prefill", "--kv-port", str(free_port()),
                          "--kv-transfer-timeout", "8")
    yield server
    server.close()


@pytest.fixture(scope="module")
def decode():
    server = RemoteServer(*COMMON, "--kv-role", "decode", "--kv-transfer-timeout", "8")
    yield server
    server.close()


@pytest.fixture(scope="module")
def proxy(prefill, decode):
    server = RemoteServer("--prefill", prefill.url, "--decode", decode.url, "--health-check-interval", "0.2",
                          "--local-prefill-below", "0", subcommand="proxy")  # every prompt through the prefill side
    yield server
    server.close()


@pytest.fixture(scope="module")
def conditional_proxy(prefill, decode):
    server = RemoteServer("--prefill", prefill.url, "--decode", decode.url, "--health-check-interval", "0.2",
                          "--local-prefill-below", "64", subcommand="proxy")
    yield server
    server.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(server: RemoteServer, prompt: str = PROMPTS[0], max_tokens: int = 8, **kwargs):
    return server.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                              temperature=0, **kwargs)


def chat(server: RemoteServer, text: str, **kwargs):
    return server.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": text}],
                                                   max_completion_tokens=8, temperature=0, **kwargs)


def stream_text(server: RemoteServer, prompt: str, **kwargs) -> tuple[str, openai.types.CompletionUsage]:
    chunks = list(server.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}, **kwargs))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage


def stream_chat(server: RemoteServer, text: str) -> str:
    chunks = server.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": text}],
                                                     max_completion_tokens=8, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def assert_idle(*servers: RemoteServer) -> None:
    for server in servers:
        server.wait_for_idle_engine(timeout=10)


def test_proxied_completion_matches_a_single_instance_and_decode_computes_no_prompt(proxy, prefill, decode, single):
    before, prefill_before = decode.metrics(), prefill.metrics()
    for prompt in PROMPTS[2:5]:
        got, want = complete(proxy, prompt), complete(single, prompt)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage == want.usage
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
    after = decode.metrics()
    assert after[COMPUTED] == before[COMPUTED]  # every prompt token came from the prefill instance
    assert after[BYTES] > before[BYTES]
    assert after["inferno:kv_transfer_seconds_count"] == before.get("inferno:kv_transfer_seconds_count", 0) + 3
    assert prefill.metrics()[COMPUTED] > prefill_before[COMPUTED]
    assert_idle(prefill, decode)


def test_proxied_streams_and_chat_match_a_single_instance(proxy, single, decode):
    before = decode.metrics()
    assert stream_text(proxy, PROMPTS[3]) == stream_text(single, PROMPTS[3])
    got, want = chat(proxy, "What is the capital of France?"), chat(single, "What is the capital of France?")
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage == want.usage
    # the same chat again, streamed, against the single instance's second answer (a prefix-cache hit on both paths)
    assert stream_chat(proxy, "What is the capital of France?") == stream_chat(single, "What is the capital of France?")
    assert decode.metrics()[COMPUTED] == before[COMPUTED]


def test_short_prompts_are_computed_on_the_decode_instance_and_long_ones_transferred(conditional_proxy, single,
                                                                                     prefill, decode):
    """Before the test that kills the decode instance."""
    transfers = "inferno:kv_transfer_seconds_count"
    before, prefill_before = decode.metrics(), prefill.metrics()
    got, want = complete(conditional_proxy, PROMPTS[5]), complete(single, PROMPTS[5])
    assert got.choices[0].text == want.choices[0].text and got.usage == want.usage
    got, want = chat(conditional_proxy, "Hi!"), chat(single, "Hi!")  # counted with the chat template
    assert got.choices[0].message.content == want.choices[0].message.content and got.usage == want.usage
    middle = decode.metrics()
    assert prefill.metrics()[COMPUTED] == prefill_before[COMPUTED]  # the prefill instance saw neither
    assert middle[COMPUTED] > before[COMPUTED]  # the decode instance computed them
    assert middle.get(transfers, 0) == before.get(transfers, 0)
    # about 100 tokens, sharing no block with LONG_PROMPT (whose transfers a later test counts)
    long = "Sailors watch the clouds, the tides and the wind before they leave the harbour. " * 6 + "Why? Answer:"
    got, want = complete(conditional_proxy, long), complete(single, long)
    assert got.choices[0].text == want.choices[0].text and got.usage == want.usage
    assert got.usage.prompt_tokens >= 64
    after = decode.metrics()
    assert after[COMPUTED] == middle[COMPUTED] and after[transfers] == middle.get(transfers, 0) + 1
    assert prefill.metrics()[COMPUTED] > prefill_before[COMPUTED]
    assert_idle(prefill, decode)


def test_32_concurrent_proxied_streams_match_a_single_instance(proxy, single, prefill, decode):
    want = [complete(single, p, extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
    before = decode.metrics()

    async def stream(client: openai.AsyncOpenAI, prompt: str) -> str:
        chunks = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in chunks])

    async def run_all() -> list[str]:
        async with proxy.async_client() as client:
            return await asyncio.gather(*(stream(client, PROMPTS[i % 8]) for i in range(32)))

    assert asyncio.run(run_all()) == [want[i % 8] for i in range(32)]
    assert decode.metrics()[COMPUTED] == before[COMPUTED]
    assert_idle(prefill, decode)


def test_n2_and_stop_strings_match_a_single_instance(proxy, single, decode):
    before = decode.metrics()
    got, want = complete(proxy, PROMPTS[3], n=2), complete(single, PROMPTS[3], n=2)
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    # the second sample shares the pulled prompt and computes only its last token, for a first token of its own
    assert decode.metrics()[COMPUTED] == before[COMPUTED] + 1
    stop = complete(single, PROMPTS[3]).choices[0].text.split()[-2]  # a word in the middle of the greedy text
    got, want = complete(proxy, PROMPTS[3], stop=[stop]), complete(single, PROMPTS[3], stop=[stop])
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want.choices[0].text, want.choices[0].finish_reason)
    assert got.choices[0].finish_reason == "stop"


def test_prefix_cache_hits_on_both_sides_and_decode_pulls_only_the_missing_blocks(proxy, single, decode, prefill):
    start = decode.metrics()
    first = complete(proxy, LONG_PROMPT, max_tokens=2)
    middle, prefill_middle = decode.metrics(), prefill.metrics()
    longer = LONG_PROMPT + "Is it windy today?"
    got = complete(proxy, longer, max_tokens=4)
    end, prefill_end = decode.metrics(), prefill.metrics()
    assert got.choices[0].text == complete(single, longer, max_tokens=4).choices[0].text
    block_bytes = (middle[BYTES] - start[BYTES]) / -(-first.usage.prompt_tokens // 16)
    hits = end["inferno:prefix_cache_hits_total"] - middle["inferno:prefix_cache_hits_total"]
    assert hits >= 16 * 4
    assert end[BYTES] - middle[BYTES] == block_bytes * (-(-got.usage.prompt_tokens // 16) - hits // 16)
    assert end[COMPUTED] == start[COMPUTED]
    assert prefill_end["inferno:prefix_cache_hits_total"] - prefill_middle["inferno:prefix_cache_hits_total"] >= hits
    assert_idle(prefill, decode)


def test_bad_input_through_the_proxy_is_a_400_with_openai_error_body(proxy):
    assert [m.id for m in proxy.client().models.list()] == [MODEL_NAME]
    with pytest.raises(openai.BadRequestError) as error:
        complete(proxy, top_p=0)
    assert error.value.status_code == 400 and error.value.body["type"] == "invalid_request_error"
    response = httpx.post(f"{proxy.url}/v1/completions", content=b"{not json", timeout=10)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_client_leaving_mid_stream_frees_blocks_on_both_sides(proxy, prefill, decode):
    before = decode.metrics()
    stream = proxy.client().completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=400, stream=True,
                                               extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()
    assert_idle(prefill, decode)
    abort = "inferno:request_success_total{finished_reason=abort}"
    assert decode.metrics()[abort] == before[abort] + 1


def remote_prefill(port: int, transfer_id: int, num_prompt_tokens: int, first_token_id: int) -> dict:
    return {"kv_transfer_params": {"remote_host": "127.0.0.1", "remote_port": port, "transfer_id": transfer_id,
                                   "num_prompt_tokens": num_prompt_tokens, "first_token_id": first_token_id}}


def test_unreachable_prefill_peer_falls_back_to_computing_the_prompt(decode, single):
    want = complete(single)
    before = decode.metrics()
    got = complete(decode, extra_body=remote_prefill(free_port(), 1, want.usage.prompt_tokens, 0))
    assert got.choices[0].text == want.choices[0].text  # recomputed: the bogus first token was not used
    after = decode.metrics()
    assert after[FAILURES] == before[FAILURES] + 1
    assert after[COMPUTED] == before[COMPUTED] + want.usage.prompt_tokens
    assert_idle(decode)


def test_transfer_the_prefill_does_not_hold_falls_back_and_wrong_params_are_a_400(decode, prefill, single):
    want = complete(single)
    answer = httpx.post(f"{prefill.url}/v1/completions", timeout=60, json={
        "prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}})
    kv = answer.json()["kv_transfer_params"]
    assert kv["num_prompt_tokens"] == want.usage.prompt_tokens
    got = complete(decode, extra_body={"kv_transfer_params": kv})
    assert got.choices[0].text == want.choices[0].text
    before = decode.metrics()
    got = complete(decode, extra_body={"kv_transfer_params": kv})  # pulled already: not held any more
    assert got.choices[0].text == want.choices[0].text
    assert decode.metrics()[FAILURES] == before[FAILURES] + 1
    with pytest.raises(openai.BadRequestError, match="prompt tokens"):
        complete(decode, prompt=LONG_PROMPT, extra_body={"kv_transfer_params": kv})
    with pytest.raises(openai.BadRequestError, match="kv-role"):
        complete(single, extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    assert_idle(prefill, decode)


def test_prefill_frees_blocks_nobody_pulls_after_its_timeout(prefill):
    before = prefill.metrics()
    httpx.post(f"{prefill.url}/v1/completions", timeout=60, json={
        "prompt": PROMPTS[2], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).raise_for_status()
    assert prefill.metrics()["inferno:kv_cache_usage_perc"] > 0  # held for a decode instance
    prefill.wait_for_idle_engine(timeout=20)  # --kv-transfer-timeout 8
    assert prefill.metrics()[FAILURES] == before[FAILURES] + 1


def test_decode_killed_mid_transfer_frees_the_prefill_blocks_and_the_proxy_stops_using_it(proxy, prefill, decode):
    answers = []
    body = {"prompt": "Tell me a long story about the sea. " * 12, "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    # stopped, the decode instance cannot pull: the prefill instance holds the blocks until the kill (a running one
    # pulls them within milliseconds, too soon to be seen); the proxy still counts it healthy for its 2 s timeout
    decode.process.send_signal(signal.SIGSTOP)
    request = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{proxy.url}/v1/completions", timeout=60, json=body)))
    request.start()
    deadline = time.monotonic() + 30
    while prefill.metrics()["inferno:kv_cache_usage_perc"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)  # until the prefill instance holds the prompt's blocks for the decode instance
    assert prefill.metrics()["inferno:kv_cache_usage_perc"] > 0
    decode.process.send_signal(signal.SIGKILL)
    request.join()
    assert "error" in answers[0].text  # a 503, or an error event in the stream
    prefill.wait_for_idle_engine(timeout=15)  # sent, failed to send, or not pulled within --kv-transfer-timeout
    health = wait_for_health(proxy, 503)
    assert [i["healthy"] for i in health["decode"]] == [False]
    with pytest.raises(openai.APIStatusError) as error:
        complete(proxy)
    assert error.value.status_code == 503


def wait_for_health(server: RemoteServer, status: int, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = httpx.get(f"{server.url}/health", timeout=2)
        if response.status_code == status:
            return response.json()
        time.sleep(0.1)
    pytest.fail(f"{server.url}/health did not answer {status} within {timeout} s")


def test_error_fallback_fails_the_request_and_frees_its_blocks():
    engine = LLMEngine(EngineConfig(kv_role="decode", kv_transfer_fallback="error", kv_transfer_timeout=1,
                                    kv_cache_memory=16 << 20, max_model_len=256, num_threads=1))
    try:
        prompt = list(range(100, 140))
        kv = KVTransferParams(remote_host="127.0.0.1", remote_port=free_port(), transfer_id=1,
                              num_prompt_tokens=len(prompt), first_token_id=0)
        engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, kv_transfer_params=kv))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert "could not be transferred" in outputs[-1].error and outputs[-1].finished
        assert engine.scheduler.num_computed_prompt_tokens == 0
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_engine_waiting_only_for_a_transfer_sleeps_and_frees_the_hold_at_its_deadline():
    """A prefill instance holding blocks for a decode instance that never pulls them has nothing to run: its steps
    wait on the connector instead of spinning (a spinning loop kept a core and the GIL from the transfer threads),
    and still free the blocks when the hold expires."""
    engine = LLMEngine(EngineConfig(kv_role="prefill", kv_port=free_port(), kv_transfer_timeout=1,
                                    kv_cache_memory=16 << 20, max_model_len=256, num_threads=1))
    try:
        params = SamplingParams(max_tokens=1, kv_transfer_params=KVTransferParams(do_remote_decode=True))
        engine.add_request("r", {"prompt_token_ids": list(range(100, 140))}, params)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.has_pending_kv_transfers() and engine.num_free_blocks < engine.num_blocks
        start, cpu_start, steps = time.monotonic(), time.thread_time(), 0
        while engine.has_pending_kv_transfers() and time.monotonic() - start < 10:
            engine.step()
            steps += 1
        wall, cpu = time.monotonic() - start, time.thread_time() - cpu_start
        assert not engine.has_pending_kv_transfers() and wall < 1.5  # freed at the 1 s deadline, not much later
        assert cpu < 0.25 * wall and steps < 2 * wall / 0.005, (cpu, wall, steps)
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()
