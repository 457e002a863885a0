"""Structured outputs and tool calling through the live server with the official openai client."""
import json
import os
import time
from pathlib import Path

import httpx
import openai
import pydantic
import pytest

from test_server import RemoteServer

MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"
# a model whose chat template calls tools (not in CI): $INFERNO_TOOL_MODEL or the repository's models/ folder
QWEN = Path(os.environ.get("INFERNO_TOOL_MODEL") or
            Path(__file__).parent.parent / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
WEATHER_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                       "required": ["zone"], "additionalProperties": False}}},
]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris in celsius?"}]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    country: str = pydantic.Field(max_length=16)
    population: int = pydantic.Field(ge=0, le=100_000_000)


@pytest.fixture(scope="module")
def server():
    server = RemoteServer("--max-model-len", "512", "--kv-cache-memory", str(128 << 20))
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def test_parse_returns_a_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        max_completion_tokens=80, temperature=0)
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_json_object_and_structured_outputs_on_completions(client):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Some JSON?"}],
                                          response_format={"type": "json_object"}, max_completion_tokens=40,
                                          temperature=0).choices[0]
    # any object: strings are unbounded, so a cut-off reply is an object's beginning
    assert chat.message.content.startswith("{")
    if chat.finish_reason == "stop":
        assert isinstance(json.loads(chat.message.content), dict)
    choice = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=8, temperature=1.0, n=4,
                                       extra_body={"structured_outputs": {"choice": ["blue", "grey"]}})
    assert {c.text for c in choice.choices} <= {"blue", "grey"}
    regex = client.completions.create(model=MODEL_NAME, prompt="Call", max_tokens=12, temperature=1.0,
                                      extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert len(regex.choices[0].text) == 8 and regex.choices[0].text[3] == "-"


@pytest.mark.parametrize("kwargs, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"pattern": "a"}}}, "structured_outputs"),
    ({"tools": WEATHER_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": WEATHER_TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
])
def test_bad_constraints_and_tool_choices_are_400s_with_openai_error_bodies(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL_NAME, messages=WEATHER_QUESTION, max_completion_tokens=4, **kwargs)
    body = error.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param and body["message"]


def stream_calls(client, model: str, **kwargs) -> tuple[list[dict], str | None]:
    """The tool calls assembled from a streamed reply's deltas, and its finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model=model, stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert "<tool_call>" not in (choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
                if call.function.name:
                    assert entry == {"name": None, "arguments": ""}, "a call's name comes first"
                    entry["name"] = call.function.name
                entry["arguments"] += call.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def check_round_trip(client, model: str, tool_choice, max_tokens: int = 80) -> list[dict]:
    """Non-streamed and streamed replies make the same valid calls; returns them."""
    kwargs = dict(messages=WEATHER_QUESTION, tools=WEATHER_TOOLS, tool_choice=tool_choice, temperature=0,
                  max_completion_tokens=max_tokens)
    whole = client.chat.completions.create(model=model, **kwargs).choices[0]
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls or []]
    assert calls and whole.finish_reason == "tool_calls", whole
    for call in calls:
        assert call["name"] in ("get_weather", "get_time") and isinstance(json.loads(call["arguments"]), dict)
    assert stream_calls(client, model, **kwargs) == (calls, "tool_calls")
    return calls


def test_required_and_named_tool_choice_are_constrained_and_stream_alike(client):
    check_round_trip(client, MODEL_NAME, "required")
    calls = check_round_trip(client, MODEL_NAME, {"type": "function", "function": {"name": "get_time"}})
    assert [c["name"] for c in calls] == ["get_time"]
    assert set(json.loads(calls[0]["arguments"])) == {"zone"}


@pytest.fixture(scope="module")
def qwen_server():
    if not QWEN.is_file():
        pytest.skip(f"{QWEN} is not here (see ../shared/models/README.md)")
    # The reply's first token is a near tie between '{"' (a bare call) and '```' (a fenced one): 0.01-0.05 apart
    # either way in float32, depending on the path (stored blocks or tiles, a prompt computed whole or after a cached
    # prefix). The replies compared take the same path: no prefix caching, and after the warm-up (which starts
    # after the first step) has tiled the weights.
    server = RemoteServer("--model", str(QWEN), "--max-model-len", "1024", "--kv-cache-memory", str(128 << 20),
                          "--dtype", "float32", "--no-enable-prefix-caching")
    server.client().completions.create(model=QWEN.stem, prompt="Hi", max_tokens=1)
    deadline = time.monotonic() + 60
    while "regrouped into tiles" not in server.output() and time.monotonic() < deadline:
        time.sleep(0.2)
    yield server
    server.close()


def test_qwen_auto_tool_call_round_trip(qwen_server):
    client = qwen_server.client()
    model = QWEN.stem
    calls = check_round_trip(client, model, "auto")
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"])["city"] == "Paris"
    history = WEATHER_QUESTION + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": calls[0]}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "unit": "celsius"})}]
    # the call and its result reach the chat template (the arguments as a mapping, the result as a tool turn)
    tokens = httpx.post(f"{qwen_server.url}/tokenize", json={"messages": history, "tools": WEATHER_TOOLS}).json()
    rendered = httpx.post(f"{qwen_server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert '"arguments": {"city": "Paris"' in rendered and '{"temperature": 21, "unit": "celsius"}' in rendered
    answer = client.chat.completions.create(model=model, messages=history, tools=WEATHER_TOOLS, temperature=0,
                                            max_completion_tokens=40).choices[0]
    assert answer.message.content or answer.message.tool_calls
