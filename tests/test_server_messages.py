"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) against the official anthropic client: a live
server with an API key, started once for the module (and one with a reasoning parser for the thinking tests)."""
import json

import anthropic
import httpx
import pytest
from anthropic.lib.streaming._messages import accumulate_event

from inferno.server.chat_output import ChatDeltaTracker, ChatOutputParser
from inferno.server.messages_output import ContentBlockEvents, content_blocks, sse_event
from inferno.server.protocol import DeltaMessage
from inferno.server.reasoning import reasoning_parser
from inferno.server.tool_parsers import HermesToolParser
from test_server import RemoteServer

API_KEY = "messages-key"
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"
MAX_MODEL_LEN = 512
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
SYSTEM = "You are a helpful geography teacher."
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                 "required": ["city"], "additionalProperties": False}}
TIME_TOOL = {"name": "get_time", "description": "Current time in a time zone",
             "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                              "required": ["zone"], "additionalProperties": False}}
GREEDY = {"temperature": 0}
AUTH = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def server():
    # float32 weights, as test_server's: greedy replies compared across routes and streaming stay clear of ties;
    # eager steps: no background compile competing for the CPU with these short requests
    server = RemoteServer("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(64 << 20),
                          "--quantization", "none", "--dtype", "float32", "--enforce-eager",
                          "--disable-uvicorn-access-log", api_key=API_KEY)
    yield server
    server.close()


def anthropic_client(server: RemoteServer, api_key: str = API_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic_client(server)


def create(client: anthropic.Anthropic, **kwargs):
    """A greedy message (this SDK no longer names temperature, top_p or top_k: they go as extra fields)."""
    return client.messages.create(**({"model": MODEL_NAME, "max_tokens": 8, "messages": QUESTION,
                                      "extra_body": GREEDY} | kwargs))


def dumped(blocks) -> list[dict]:
    """Content blocks as JSON (the stream helper's blocks are subclasses with more fields)."""
    return [block.to_dict(exclude_none=True) for block in blocks]


def post(server: RemoteServer, path: str, body, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def assert_anthropic_error(response: httpx.Response, status: int, error_type: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == error_type and body["error"]["message"]


def stream_events(server: RemoteServer, body: dict) -> list[tuple[str, dict]]:
    """(event line, data) of each server-sent event of a streamed request."""
    events = []
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body | {"stream": True}, headers=AUTH,
                      timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for chunk in response.read().decode().split("\n\n"):
            if chunk.strip():
                event, data = chunk.split("\n")
                events.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


# messages
def test_message_text_is_chat_completions_greedy_reply(server, client):
    message = create(client, system=SYSTEM)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL_NAME
    assert message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    chat = server.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "system", "content": SYSTEM}, *QUESTION], max_completion_tokens=8,
        temperature=0)
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens


def test_streamed_and_non_streamed_messages_agree(client):
    message = create(client, max_tokens=8)
    streamed = list(create(client, max_tokens=8, stream=True))
    assert streamed[0].type == "message_start" and streamed[-1].type == "message_stop"
    text = "".join(e.delta.text for e in streamed if e.type == "content_block_delta")
    assert text == message.content[0].text
    [delta] = [e for e in streamed if e.type == "message_delta"]
    assert delta.delta.stop_reason == message.stop_reason
    assert delta.usage.output_tokens == message.usage.output_tokens
    with client.messages.stream(model=MODEL_NAME, max_tokens=8, messages=QUESTION, extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == message.content[0].text
        final = stream.get_final_message()
    assert dumped(final.content) == dumped(message.content) and final.stop_reason == message.stop_reason
    assert final.usage.input_tokens == message.usage.input_tokens


def test_stream_follows_anthropics_event_sequence(server):
    events = stream_events(server, {"model": MODEL_NAME, "max_tokens": 6, "messages": QUESTION, "temperature": 0})
    assert all(event == data["type"] for event, data in events)
    kinds = [event for event, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert events[0][1]["message"]["content"] == [] and events[0][1]["message"]["stop_reason"] is None
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 6


def test_max_tokens_and_stop_sequences_set_the_stop_reason(client):
    long = create(client, max_tokens=10, messages=STORY)
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 10
    text = long.content[0].text
    word = text.split()[2]
    stopped = create(client, max_tokens=10, messages=STORY, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[:text.index(word)]
    streamed = client.messages.stream(model=MODEL_NAME, max_tokens=10, messages=STORY, extra_body=GREEDY,
                                      stop_sequences=[word])
    with streamed as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", word)
    assert dumped(final.content) == dumped(stopped.content)


def test_max_tokens_beyond_the_context_is_cut_to_it(client):
    def words(n: int) -> list[dict]:
        return [{"role": "user", "content": "Say more words:" + " word" * n}]

    base, ten = (client.messages.count_tokens(model=MODEL_NAME, messages=words(n)).input_tokens for n in (0, 10))
    n = (MAX_MODEL_LEN - 4 - base) * 10 // (ten - base)  # a prompt that leaves about 4 tokens for the reply
    message = create(client, max_tokens=100_000, messages=words(n))
    assert MAX_MODEL_LEN - 8 <= message.usage.input_tokens <= MAX_MODEL_LEN - 4
    used = message.usage.input_tokens + message.usage.output_tokens
    assert (message.stop_reason, used) == ("model_context_window_exceeded", MAX_MODEL_LEN) or \
        (message.stop_reason == "end_turn" and used <= MAX_MODEL_LEN)


def test_count_tokens_is_the_prompt_the_message_used(client):
    kwargs = dict(system=[{"type": "text", "text": SYSTEM}], tools=[WEATHER_TOOL],
                  messages=[{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}])
    counted = client.messages.count_tokens(model=MODEL_NAME, **kwargs)
    message = create(client, max_tokens=2, **kwargs)
    assert counted.input_tokens == message.usage.input_tokens > 20


# tools
def test_tool_use_round_trip(server, client):
    ask = dict(tools=[WEATHER_TOOL, TIME_TOOL], messages=[{"role": "user", "content": "What is the weather in Paris?"}],
               max_tokens=40)
    message = create(client, tool_choice={"type": "tool", "name": "get_weather"}, **ask)
    assert message.stop_reason == "tool_use"
    [call] = message.content
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    assert set(call.input) == {"city"} and isinstance(call.input["city"], str)
    history = ask["messages"] + [
        {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "21 degrees and sunny"}]},
                                     {"type": "text", "text": "Thanks. Tell me in a sentence."}]}]
    answer = create(client, tools=ask["tools"], messages=history, max_tokens=8)
    assert answer.content and answer.content[0].type == "text"
    # the call and its result reach the chat template as chat's assistant tool_calls and tool message do
    chat_history = [ask["messages"][0],
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
                    {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and sunny"},
                    {"role": "user", "content": "Thanks. Tell me in a sentence."}]
    openai_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                      "parameters": t["input_schema"]}} for t in ask["tools"]]
    tokens = post(server, "/tokenize", {"messages": chat_history, "tools": openai_tools},
                  headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert answer.usage.input_tokens == tokens["count"]


def test_tool_choice_any_streams_input_json_like_the_whole_message(client):
    kwargs = dict(tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=40,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  messages=[{"role": "user", "content": "What time is it in Tokyo?"}])
    message = create(client, **kwargs)
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]
    with client.messages.stream(model=MODEL_NAME, extra_body=GREEDY, **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    [whole], [streamed] = message.content, final.content
    assert (streamed.name, streamed.input) == (whole.name, whole.input) and streamed.id.startswith("toolu_")
    assert final.stop_reason == "tool_use"
    [start] = [e for e in events if e.type == "content_block_start"]
    assert start.content_block.to_dict() == {"type": "tool_use", "id": streamed.id, "name": whole.name, "input": {}}
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert len([e for e in events if e.type == "content_block_delta"]) > 1 and json.loads(partial) == whole.input


def test_tool_choice_none_keeps_tools_out_of_the_prompt(client):
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=QUESTION, tools=[WEATHER_TOOL],
                                           tool_choice={"type": "none"})
    assert counted.input_tokens == client.messages.count_tokens(model=MODEL_NAME, messages=QUESTION).input_tokens


# errors and authentication
BAD_BODIES = [
    {"max_tokens": None},  # required
    {"max_tokens": 0},
    {"temperature": 1.5},
    {"top_p": 0},
    {"top_k": -1},
    {"messages": []},
    {"messages": [{"role": "system", "content": "hi"}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                "content": [{"type": "image"}]}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": {}}]}]},
    {"tools": [{"name": "x"}]},
    {"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]},
    {"tool_choice": {"type": "any"}},
    {"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool"}},
    {"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
    {"tools": [WEATHER_TOOL], "tool_choice": {"type": "sometimes"}},
    {"thinking": {"type": "maybe"}},
    {"stop_sequences": [""]},
    {"system": [{"type": "image"}]},
    {"messages": [{"role": "user", "content": "word " * 600}]},
]


@pytest.mark.parametrize("fields", BAD_BODIES, ids=[str(b)[:50] for b in BAD_BODIES])
def test_bad_requests_get_400_in_anthropics_shape(server, fields):
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": QUESTION} | fields
    assert_anthropic_error(post(server, "/v1/messages", body), 400, "invalid_request_error")


@pytest.mark.parametrize("body", [b'{"model": "x",', b"not json", b"[1, 2]", b""],
                         ids=["truncated", "text", "array", "empty"])
def test_malformed_json_gets_400_in_anthropics_shape(server, body):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        response = httpx.post(f"{server.url}{path}", content=body, headers=AUTH | {"content-type": "application/json"})
        assert_anthropic_error(response, 400, "invalid_request_error")
    server.wait_for_idle_engine(timeout=5)


def test_invalid_request_raises_the_clients_bad_request_error(client):
    with pytest.raises(anthropic.BadRequestError) as raised:
        create(client, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert raised.value.body["type"] == "error" and raised.value.body["error"]["type"] == "invalid_request_error"
    assert "'image'" in raised.value.body["error"]["message"]


def test_unknown_model_is_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as raised:
        create(client, model="not-the-served-model")
    assert raised.value.body["error"]["type"] == "not_found_error"


def test_api_key_as_x_api_key_or_bearer_and_a_wrong_key_is_an_authentication_error(server):
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=API_KEY, max_retries=0)
    assert create(bearer, max_tokens=1).usage.output_tokens == 1
    with pytest.raises(anthropic.AuthenticationError) as raised:
        create(anthropic_client(server, api_key="wrong"), max_tokens=1)
    assert raised.value.body["error"]["type"] == "authentication_error"
    assert_anthropic_error(post(server, "/v1/messages/count_tokens", {"model": MODEL_NAME, "messages": QUESTION},
                                headers={}), 401, "authentication_error")
    assert_anthropic_error(httpx.get(f"{server.url}/v1/messages/nothing", headers=AUTH), 404, "not_found_error")


def test_dropped_message_stream_is_aborted(server):
    with httpx.stream("POST", f"{server.url}/v1/messages", headers=AUTH, timeout=60,
                      json={"model": MODEL_NAME, "max_tokens": 400, "messages": QUESTION, "stream": True}) as response:
        lines = response.iter_lines()
        while "content_block_delta" not in next(lines):
            pass
    server.wait_for_idle_engine(timeout=2.0)


# thinking
@pytest.fixture(scope="module")
def thinking_server():
    # deepseek_r1: the reply starts inside the reasoning, so without </think> all of it is reasoning
    server = RemoteServer("--max-model-len", "256", "--kv-cache-memory", str(32 << 20), "--quantization", "none",
                          "--dtype", "float32", "--enforce-eager", "--reasoning-parser", "deepseek_r1")
    yield server
    server.close()


def test_thinking_blocks_carry_chat_completions_reasoning(thinking_server):
    client = anthropic_client(thinking_server, api_key="unused")
    thinking = {"type": "enabled", "budget_tokens": 1024}
    message = create(client, thinking=thinking)
    chat = thinking_server.client().chat.completions.create(model=MODEL_NAME, messages=QUESTION, temperature=0,
                                                            max_completion_tokens=8)
    assert [b.type for b in message.content] == ["thinking"]
    assert message.content[0].thinking == chat.choices[0].message.reasoning_content
    with client.messages.stream(model=MODEL_NAME, max_tokens=8, messages=QUESTION, extra_body=GREEDY,
                                thinking=thinking) as stream:
        assert dumped(stream.get_final_message().content) == dumped(message.content)
    assert create(client, thinking={"type": "disabled"}).content == []


# streamed blocks, without a server: what a model that thinks and calls tools writes (SmolLM2 does neither)
HERMES_REPLY = ('<think>The user wants weather and time.</think>\nLet me look both up.\n<tool_call>\n'
                '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
                '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>')


def sdk_accumulated(events: list[str]):
    """The message the anthropic SDK's stream helper assembles from server-sent events."""
    snapshot, json_bufs = None, {}
    for event in events:
        data = json.loads(event.split("\ndata: ", 1)[1])
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=json_bufs)
    return snapshot


@pytest.mark.parametrize("chunk_size", [1, 3, 7])
@pytest.mark.parametrize("max_tool_uses", [None, 1])
@pytest.mark.parametrize("thinking", [True, False])
def test_streamed_blocks_add_up_to_the_whole_message(thinking, max_tool_uses, chunk_size):
    parser = ChatOutputParser(reasoning_parser("qwen3"), HermesToolParser())
    whole = content_blocks(parser.parse(HERMES_REPLY, final=True), thinking, max_tool_uses)
    tracker, blocks = ChatDeltaTracker(parser), ContentBlockEvents(thinking, max_tool_uses)
    events = [sse_event({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
                                                             "content": [], "model": "m", "usage": {}}})]
    chunks = [HERMES_REPLY[i:i + chunk_size] for i in range(0, len(HERMES_REPLY), chunk_size)]
    for i, chunk in enumerate(chunks):
        delta = tracker.delta(chunk, final=i == len(chunks) - 1)
        events += blocks.events(delta) if delta is not None else []
    events += blocks.finish()
    streamed = sdk_accumulated(events).content
    expected = (["thinking"] if thinking else []) + ["text"] + ["tool_use"] * (max_tool_uses or 2)
    assert [b.type for b in whole] == [b.type for b in streamed] == expected
    for mine, theirs in zip(whole, streamed):
        assert mine.model_dump(exclude={"id"}) == {k: v for k, v in theirs.to_dict().items() if k != "id"}
    assert whole[-1].input == ({"city": "Paris"} if max_tool_uses else {"zone": "Europe/Paris"})
    assert blocks.num_tool_uses == (max_tool_uses or 2)


def test_whitespace_is_held_only_until_more_text_comes():
    blocks = ContentBlockEvents(thinking=False, max_tool_uses=None)
    events = [sse_event({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
                                                             "content": [], "model": "m", "usage": {}}})]
    for text in ("Hello ", " ", "world\n", "!\n\n"):
        events += blocks.events(DeltaMessage(content=text))
    events += blocks.finish()
    assert [b.text for b in sdk_accumulated(events).content] == ["Hello  world\n!\n\n"]
