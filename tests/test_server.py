"""`inferno serve` against the official openai client: a live server on 127.0.0.1, started once for the module."""
import asyncio
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = "The capital of France is"
STARTUP_TIMEOUT_S = 300


class RemoteServer:
    """`inferno serve ARGS` (or another subcommand) in a subprocess on a free port, ready once /health answers;
    `launcher`: what the command runs under (`ip netns exec NAME` to serve at `host` in a network namespace)."""

    def __init__(self, *args: str, api_key: str | None = None, subcommand: str = "serve", host: str = "127.0.0.1",
                 launcher: tuple[str, ...] = ()):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"inferno-{subcommand}-", suffix=".log")
        command = [*launcher, sys.executable, "-c", "from inferno.entrypoints.cli import main; main()", subcommand,
                   "--host", host, "--port", str(self.port), *args]
        if api_key:
            command += ["--api-key", api_key]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        cwd=Path(__file__).parent.parent)
        self._wait_until_healthy()

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.close()
                pytest.fail(f"server exited with {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.close()
        pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-5000:]

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0,
                             timeout=120, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0,
                                  timeout=120)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed `name` or `name{label=value}` (model_name left out)."""
        samples = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics").text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def wait_for_idle_engine(self, timeout: float) -> float:
        """Seconds until no request runs or waits and the KV cache is empty; fails after `timeout`."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            m = self.metrics()
            if (m["inferno:num_requests_running"], m["inferno:num_requests_waiting"],
                    m["inferno:kv_cache_usage_perc"]) == (0, 0, 0):
                return time.monotonic() - start
            time.sleep(0.02)
        pytest.fail(f"engine still busy after {timeout} s: {self.metrics()}")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server():
    # the float32 model of the `llm` fixture, which test_completion_beam_search_returns_the_offline_beams compares with
    server = RemoteServer("--max-model-len", "512", "--kv-cache-memory", str(256 << 20),
                          "--quantization", "none", "--dtype", "float32")
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def greedy_completion(client: openai.OpenAI, prompt: str = PROMPT, max_tokens: int = 8, **kwargs):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}, **kwargs)


def chat_messages(text: str = "What is the capital of France?") -> list[dict]:
    return [{"role": "user", "content": text}]


# routes
def test_models_lists_the_served_model(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].max_model_len == 512
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_tokenize_and_detokenize_round_trip(server):
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) > 0
    assert "".join(tokens["token_strs"]) == PROMPT
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": PROMPT}
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": chat_messages()}).json()
    assert chat["count"] > tokens["count"]


# completions
def test_completion_returns_text_usage_and_finish_reason(client):
    completion = greedy_completion(client)
    assert completion.object == "text_completion" and completion.model == MODEL_NAME
    [choice] = completion.choices
    assert choice.index == 0 and choice.text and choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens == 5
    assert completion.usage.total_tokens == 13


def test_streamed_completion_concatenates_to_the_greedy_text(client):
    expected = greedy_completion(client).choices[0].text
    stream = greedy_completion(client, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_completion_n2_returns_two_indexed_choices(client):
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=2, max_tokens=4, temperature=1.0,
                                           seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in completion.choices) == [0, 1]
    assert completion.usage.completion_tokens == 8


def test_completion_logprobs_in_openai_format(client):
    completion = greedy_completion(client, max_tokens=6, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0 and 2 <= len(top) <= 3
        assert top[token] == logprob == max(top.values())  # greedy picks the most likely token


def test_completion_echo_prepends_the_prompt(client):
    completion = greedy_completion(client, max_tokens=4, echo=True, logprobs=1)
    plain = greedy_completion(client, max_tokens=4).choices[0].text
    choice = completion.choices[0]
    assert choice.text == PROMPT + plain
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == 5 + 4


def test_completion_stop_string_ends_the_text(client):
    text = greedy_completion(client, max_tokens=12).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    completion = greedy_completion(client, max_tokens=12, stop=[stop])
    assert completion.choices[0].text == text[:text.index(stop)]
    assert completion.choices[0].finish_reason == "stop"


def test_completion_seed_reproduces_sampling(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    assert sample(1234) == sample(1234)


def test_completion_of_several_prompts(client):
    completion = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "Once upon a time"], max_tokens=3,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in sorted(completion.choices, key=lambda c: c.index)] == [0, 1]
    assert completion.choices[0].text == greedy_completion(client, max_tokens=3).choices[0].text


def test_request_id_header_is_honoured(client):
    response = client.completions.with_raw_response.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=1, extra_headers={"X-Request-Id": "my-request-7"})
    assert response.headers["x-request-id"] == "cmpl-my-request-7"
    assert response.parse().id == "cmpl-my-request-7"


# chat
def test_chat_completion_and_its_stream_agree(client):
    kwargs = dict(model=MODEL_NAME, messages=chat_messages(), max_tokens=8, temperature=0)
    completion = client.chat.completions.create(**kwargs)
    [choice] = completion.choices
    assert completion.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage.prompt_tokens > 10 and 0 < completion.usage.completion_tokens <= 8
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage.model_dump() == completion.usage.model_dump()


def test_chat_logprobs_in_openai_format(client):
    completion = client.chat.completions.create(model=MODEL_NAME, messages=chat_messages(), max_tokens=4,
                                                temperature=0, logprobs=True, top_logprobs=3)
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert bytes(entry.bytes).decode() == entry.token


def test_chat_max_completion_tokens_and_n(client):
    completion = client.chat.completions.create(model=MODEL_NAME, messages=chat_messages(), n=2,
                                                max_completion_tokens=3, temperature=0.8, seed=3,
                                                extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.05,
                                                            "repetition_penalty": 1.1})
    assert sorted(c.index for c in completion.choices) == [0, 1]
    assert completion.usage.completion_tokens == 6


# concurrency and leaks
def test_32_concurrent_streams_match_their_greedy_output_alone(client, server):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(8)]
    alone = [greedy_completion(client, prompt=p).choices[0].text for p in prompts]

    async def stream(async_client: openai.AsyncOpenAI, prompt: str) -> str:
        chunks = await async_client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8,
                                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in chunks])

    async def run_all() -> list[str]:
        async with server.async_client() as async_client:
            return await asyncio.gather(*(stream(async_client, prompts[i % 8]) for i in range(32)))

    texts = asyncio.run(run_all())
    assert texts == [alone[i % 8] for i in range(32)]
    server.wait_for_idle_engine(timeout=5)


def test_dropped_stream_is_aborted_and_frees_blocks_within_a_second(client, server):
    before = server.metrics()
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert server.metrics()["inferno:kv_cache_usage_perc"] > 0
    stream.close()
    assert server.wait_for_idle_engine(timeout=1.0) < 1.0
    after = server.metrics()
    abort = "inferno:request_success_total{finished_reason=abort}"
    assert after[abort] == before[abort] + 1


def test_dropped_non_streaming_request_is_aborted(server):
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=1.0,
                   json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True})
    server.wait_for_idle_engine(timeout=1.0)
    abort = "inferno:request_success_total{finished_reason=abort}"
    assert server.metrics()[abort] == before[abort] + 1


# metrics
def test_metrics_count_a_known_number_of_requests_and_tokens(client, server):
    before = server.metrics()
    usages = [greedy_completion(client, max_tokens=n).usage for n in (3, 5)]
    after = server.metrics()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("inferno:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("inferno:generation_tokens_total") == 8
    assert delta("inferno:request_success_total{finished_reason=length}") == 2
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_time_per_output_token_seconds"):
        assert delta(f"inferno:{histogram}_count") == 2
    assert delta("inferno:inter_token_latency_seconds_count") == 2 + 4
    assert after["inferno:e2e_request_latency_seconds_sum"] > before["inferno:e2e_request_latency_seconds_sum"]
    assert after["inferno:num_requests_running"] == after["inferno:num_requests_waiting"] == 0
    assert after["inferno:kv_cache_usage_perc"] == 0
    assert "inferno:num_preemptions_total" in after



def test_http_metrics_count_each_route_by_its_path_template(client, server):
    before = server.metrics()
    greedy_completion(client, max_tokens=1)
    assert httpx.get(f"{server.url}/v1/responses/resp_unknown").status_code == 404
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": -1}).status_code == 400
    after = server.metrics()

    def delta(labels: str) -> float:
        name = f"http_requests_total{{{labels}}}"
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("handler=/v1/completions,method=POST,status=2xx") == 1
    assert delta("handler=/v1/completions,method=POST,status=4xx") == 1
    assert delta("handler=/v1/responses/{response_id},method=GET,status=4xx") == 1
    duration = "http_request_duration_seconds_count{handler=/v1/completions,method=POST}"
    assert after[duration] - before.get(duration, 0.0) == 2

# prefix caching and beam search
def test_prefix_cache_counters_and_reset(client, server):
    prompt = "You are a helpful assistant who answers questions about the sea and the weather. " * 6
    first = greedy_completion(client, prompt, max_tokens=2).usage.prompt_tokens
    before = server.metrics()
    second = greedy_completion(client, prompt + "Is it windy today?", max_tokens=2).usage.prompt_tokens
    after = server.metrics()
    queries = after["inferno:prefix_cache_queries_total"] - before["inferno:prefix_cache_queries_total"]
    hits = after["inferno:prefix_cache_hits_total"] - before["inferno:prefix_cache_hits_total"]
    assert queries == second
    assert hits % 16 == 0 and first - 32 <= hits <= first  # whole blocks of the shared prefix
    assert after["inferno:num_cached_blocks"] >= second // 16
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
    assert server.metrics()["inferno:num_cached_blocks"] == 0


def test_completion_beam_search_returns_the_offline_beams(client, llm):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, n=3,
                                         extra_body={"use_beam_search": True})
    (offline,) = llm.beam_search(PROMPT, beam_width=3, max_tokens=10)
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [c.text for c in offline.outputs]
    assert [c.finish_reason for c in choices] == [c.finish_reason for c in offline.outputs]


def test_beam_search_with_logprobs_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, n=2, logprobs=1,
                                  extra_body={"use_beam_search": True})
