"""Bad input, authentication and overload: OpenAI-style error bodies with the right status, never a 500.

One live server with an API key, a one-sequence batch and a one-request waiting queue.
"""
import threading

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import RemoteServer

API_KEY = "test-key"
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 128
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server():
    server = RemoteServer("--served-model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN),
                          "--kv-cache-memory", str(64 << 20), "--max-num-seqs", "1", "--max-waiting-requests", "1",
                          "--disable-uvicorn-access-log", api_key=API_KEY)
    yield server
    server.close()


def post(server: RemoteServer, path: str, body=None, headers=AUTH, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


# authentication
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}],
                         ids=["missing", "wrong", "not-bearer"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
                                  "/detokenize"])
def test_requests_without_the_api_key_get_401(server, path, headers):
    assert_error(post(server, path, {"prompt": "hi"}, headers=headers), 401, code="invalid_api_key")


def test_openai_client_with_a_wrong_key_gets_authentication_error(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    assert [m.id for m in server.client().models.list().data] == [MODEL_NAME]


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "inferno:num_requests_running" in httpx.get(f"{server.url}/metrics").text


# bad parameters
COMPLETION_CASES = [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 8, "max_tokens": 4}, "min_tokens"),
    ({"seed": 2 ** 64}, "seed"),
    ({"seed": "abc"}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [10 ** 9]}, "stop_token_ids"),
    ({"stream": [1]}, "stream"),
    ({"ignore_eos": "maybe"}, "ignore_eos"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"best_of": 2}, "best_of"),
    ({"suffix": "!"}, "suffix"),
    ({"prompt": 123}, None),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 10 ** 9]}, None),
    ({"prompt": "word " * 200}, "max_tokens"),
    ({"prompt": "word " * 200, "max_tokens": None}, None),
]


@pytest.mark.parametrize(("fields", "param"), COMPLETION_CASES, ids=[str(c[0])[:40] for c in COMPLETION_CASES])
def test_bad_completion_parameter_gets_400(server, fields, param):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2} | fields
    assert_error(post(server, "/v1/completions", body), 400, param)


CHAT_CASES = [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "word " * 200}]}, "max_completion_tokens"),
]


@pytest.mark.parametrize(("fields", "param"), CHAT_CASES, ids=[str(c[0])[:40] for c in CHAT_CASES])
def test_bad_chat_parameter_gets_400(server, fields, param):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2}
    assert_error(post(server, "/v1/chat/completions", body | fields), 400, param)


TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
RESPONSES_CASES = [
    ({"input": 123}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "no call_id"}]}, "input"),
    ({"input": "word " * 200}, "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"metadata": {"key": "v" * 513}}, "metadata"),
    ({"background": True}, "background"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text"),
    ({"text": {"format": {"type": "xml"}}}, "text"),
]


@pytest.mark.parametrize(("fields", "param"), RESPONSES_CASES, ids=[str(c[0])[:40] for c in RESPONSES_CASES])
def test_bad_responses_parameter_gets_400(server, fields, param):
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2}
    assert_error(post(server, "/v1/responses", body | fields), 400, param)


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_unknown_response_id_gets_404(server, method):
    response = httpx.request(method, f"{server.url}/v1/responses/resp_unknown", headers=AUTH)
    assert_error(response, 404)


def test_unknown_model_gets_model_not_found(server):
    with pytest.raises(openai.NotFoundError) as raised:
        server.client().completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
    assert raised.value.code == "model_not_found" and raised.value.param == "model"


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                                            ("/v1/responses", {"input": "Hi"}), ("/tokenize", {"prompt": "Hi"})])
def test_unknown_model_is_a_404_on_every_route(server, path, body):
    assert_error(post(server, path, body | {"model": "gpt-4"}), 404, "model", "model_not_found")


def test_oversize_prompt_names_the_context_length(server):
    response = post(server, "/v1/completions", {"prompt": list(range(1, MAX_MODEL_LEN + 1)), "max_tokens": None})
    assert_error(response, 400)
    assert f"max_model_len is {MAX_MODEL_LEN}" in response.json()["error"]["message"]


@pytest.mark.parametrize("body", [b'{"prompt": "hi",', b"not json", b"[1, 2]", b""],
                         ids=["truncated", "text", "array", "empty"])
def test_malformed_json_gets_400(server, body):
    response = httpx.post(f"{server.url}/v1/completions", content=body,
                          headers=AUTH | {"Content-Type": "application/json"})
    assert_error(response, 400)


def test_bad_detokenize_ids_get_400(server):
    assert_error(post(server, "/detokenize", {"tokens": [10 ** 9]}), 400, "tokens")
    assert_error(post(server, "/detokenize", {"tokens": [-1]}), 400, "tokens")


def test_unknown_route_gets_404_with_an_error_body(server):
    response = httpx.get(f"{server.url}/v1/nothing-here", headers=AUTH)
    assert response.status_code == 404 and response.json()["error"]["message"]


# overload
def test_full_waiting_queue_answers_503_and_recovers(server):
    client = server.client()
    running = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=100, stream=True,
                                        extra_body={"ignore_eos": True})
    next(iter(running))  # the one sequence slot is taken
    waiting_result = {}
    waiting = threading.Thread(target=lambda: waiting_result.update(
        response=post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})))
    waiting.start()
    try:
        for _ in range(200):
            if server.metrics()["inferno:num_requests_waiting"] == 1:
                break
            threading.Event().wait(0.02)
        assert server.metrics()["inferno:num_requests_waiting"] == 1
        assert_error(post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}), 503,
                     code="engine_overloaded")
        overloaded = post(server, "/v1/messages", {"model": MODEL_NAME, "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "Hi"}]})
        assert overloaded.status_code == 529 and overloaded.json()["error"]["type"] == "overloaded_error"
    finally:
        running.close()
        waiting.join(timeout=60)
    assert waiting_result["response"].status_code == 200
    server.wait_for_idle_engine(timeout=5)


# fuzzing
FUZZ_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/tokenize", "/detokenize",
              "/v1/messages", "/v1/messages/count_tokens"]
MAX_FUZZ_TOKENS = 2


def bound_generation(body, path: str):
    """Keep generated requests cheap on a CPU (at most 2 prompts or embedding inputs, 2 samples and 2 new tokens
    each), and give messages without content some text, so that more chat requests get past the chat template to the
    engine."""
    if not isinstance(body, dict):
        return
    for message in body.get("messages") if isinstance(body.get("messages"), list) else []:
        if isinstance(message, dict) and message.get("content") is None:
            message["content"] = "Hi"
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(name), int) and body[name] > MAX_FUZZ_TOKENS:
            body[name] = MAX_FUZZ_TOKENS
    if path == "/v1/responses":
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = MAX_FUZZ_TOKENS
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_FUZZ_TOKENS
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    for name in ("prompt", "input"):
        if isinstance(body.get(name), list) and body[name] and not isinstance(body[name][0], int):
            body[name] = body[name][:2]


@pytest.mark.parametrize("path", FUZZ_PATHS)
def test_fuzzed_requests_never_get_a_server_error(server, path):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operation = schema[path]["POST"]
    cases = st.one_of(operation.as_strategy(schemathesis.GenerationMode.POSITIVE),
                      operation.as_strategy(schemathesis.GenerationMode.NEGATIVE))

    @settings(max_examples=50, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case):
        bound_generation(case.body, path)
        if path.startswith("/v1/messages") and isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL_NAME  # required there: a random name would stop every request at the 404
        response = case.call(base_url=server.url, headers=AUTH, timeout=60)
        assert response.status_code < 500, f"{case.body!r} -> {response.status_code} {response.text}"
        if response.status_code >= 400:  # OpenAI's error body, or Anthropic's on /v1/messages
            assert response.json()["error"]["message"]

    check()
    server.wait_for_idle_engine(timeout=5)
