"""OpenAI's Responses API (/v1/responses) against the official openai client: a live server on 127.0.0.1, started
once for the module; the store, the output builder and the input adapter also on their own."""
import json

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import ResponseStreamEvent

from inferno.server.chat_output import ChatDeltaTracker, ChatOutputParser
from inferno.server.protocol_responses import (
    FunctionCallItem, MessageItem, ReasoningItem, ResponsesRequest, ResponsesResponse)
from inferno.server.response_store import ResponseStore
from inferno.server.reasoning import reasoning_parser
from inferno.server.responses_input import chat_messages
from inferno.server.responses_output import OutputBuilder
from inferno.server.tool_parsers import HermesToolParser
from test_server import RemoteServer

MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"
MAX_STORED = 8
WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}
QUESTION = "What is the capital of France?"
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)  # the SDK's own event types


@pytest.fixture(scope="module")
def server():
    # dequantized to float32 (as test_server's): greedy replies that do not depend on the path a prompt takes
    server = RemoteServer("--max-model-len", "512", "--kv-cache-memory", str(128 << 20), "--quantization", "none",
                          "--dtype", "float32", "--responses-store-max-items", str(MAX_STORED))
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def create(client: openai.OpenAI, **kwargs):
    return client.responses.create(model=MODEL_NAME, **({"temperature": 0, "max_output_tokens": 16} | kwargs))


def stream_events(client: openai.OpenAI, **kwargs) -> list:
    events = list(create(client, stream=True, **kwargs))
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events))), numbers
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    return events


def rendered_token_count(server: RemoteServer, messages: list[dict]) -> int:
    """The prompt length chat's template gives `messages` (what a Responses request must render to)."""
    return httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["count"]


# responses.create
def test_create_returns_a_message_usage_and_echoed_parameters(server, client):
    response = create(client, input=QUESTION, instructions="Answer in one sentence.", metadata={"topic": "geo"},
                      user="tester", top_p=0.9)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL_NAME
    assert response.status in ("completed", "incomplete") and response.error is None
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == response.status
    assert response.output_text == message.content[0].text and response.output_text.strip()
    assert (response.instructions, response.metadata, response.user) == ("Answer in one sentence.",
                                                                          {"topic": "geo"}, "tester")
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0, 0.9, 16)
    assert response.tool_choice == "auto" and response.tools == [] and response.parallel_tool_calls
    messages = [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": QUESTION}]
    usage = response.usage
    assert usage.input_tokens == rendered_token_count(server, messages)
    assert 0 < usage.output_tokens <= 16 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0


def test_streamed_and_non_streamed_answers_are_equal_at_temperature_0(client):
    whole = create(client, input=QUESTION)
    events = stream_events(client, input=QUESTION)
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id")) and final.output[0].id == item_id


def test_stream_helper_gives_the_final_response(client):
    with client.responses.stream(model=MODEL_NAME, input="Say hello.", temperature=0, max_output_tokens=64) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == deltas and deltas


def test_max_output_tokens_makes_an_incomplete_response(client):
    whole = create(client, input="Tell me a long story about a dragon.", max_output_tokens=3)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 3 and whole.output[0].status == "incomplete"
    events = stream_events(client, input="Tell me a long story about a dragon.", max_output_tokens=3)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == whole.output_text
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"


def test_request_id_header_names_the_response(server):
    response = httpx.post(f"{server.url}/v1/responses", headers={"X-Request-Id": "abc123"},
                          json={"input": "Hi", "max_output_tokens": 2}, timeout=60)
    assert response.status_code == 200 and response.headers["x-request-id"] == response.json()["id"] == "resp_abc123"


def test_dropped_stream_is_aborted_and_frees_its_blocks(server, client):
    stream = create(client, input="Tell me a long story.", max_output_tokens=400, stream=True)
    events = iter(stream)
    while next(events).type != "response.output_text.delta":
        pass
    assert server.metrics()["inferno:kv_cache_usage_perc"] > 0
    stream.close()
    server.wait_for_idle_engine(timeout=5)


# tools
def function_calls(output) -> list:
    assert output and all(item.type == "function_call" for item in output), output
    return output


def test_function_tool_round_trip_through_previous_response_id(server, client):
    first = create(client, input="What is the weather in Paris in celsius?", tools=[WEATHER_TOOL],
                   tool_choice="required", max_output_tokens=80)
    [call] = function_calls(first.output)
    arguments = json.loads(call.arguments)
    assert call.name == "get_weather" and call.call_id.startswith("call_") and first.status == "completed"
    jsonschema.validate(arguments, WEATHER_TOOL["parameters"])
    result = json.dumps({"temperature": 21})
    second = create(client, previous_response_id=first.id, max_output_tokens=8,
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}])
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    # the stored question and call and the new result reach the chat template as chat's messages would
    history = [{"role": "user", "content": "What is the weather in Paris in celsius?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": call.call_id, "type": "function", "function": {"name": call.name,
                                                                         "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": result}]
    assert second.usage.input_tokens == rendered_token_count(server, history)


def test_streamed_function_calls_equal_the_non_streamed_ones(client):
    named = {"type": "function", "name": "get_weather"}
    whole = create(client, input="Weather in Rome?", tools=[WEATHER_TOOL], tool_choice=named, max_output_tokens=80)
    [call] = function_calls(whole.output)
    events = stream_events(client, input="Weather in Rome?", tools=[WEATHER_TOOL], tool_choice=named,
                           max_output_tokens=80)
    added = next(e for e in events if e.type == "response.output_item.added").item
    assert (added.type, added.name, added.arguments) == ("function_call", "get_weather", "")
    assert added.status == "in_progress"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == call.arguments and json.loads(deltas)
    [streamed_call] = events[-1].response.output
    assert (streamed_call.name, streamed_call.arguments) == (call.name, call.arguments)


def test_a_codex_style_turn_is_accepted(server):
    """The fields an agent such as Codex sends on a later turn: its whole history again, unstored."""
    shell = {"type": "function", "name": "shell", "description": "Runs a command", "strict": False,
             "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                            "required": ["command"]}}
    history = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You code."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": None, "encrypted_content": None},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
         "arguments": '{"command": ["ls"]}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md"}]
    body = {"model": MODEL_NAME, "instructions": "Be brief.", "input": history, "tools": [shell], "tool_choice": "auto",
            "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"}, "store": False,
            "stream": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "abc",
            "max_output_tokens": 2}
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["output"] and response.json()["store"] is False


def test_json_schema_text_format_output_validates(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10 ** 8}},
              "required": ["city", "population"], "additionalProperties": False}
    response = create(client, input="Describe Paris as JSON.", max_output_tokens=60,
                      text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), schema)


# store
def test_store_retrieve_delete_and_unknown_ids(server, client):
    response = create(client, input="Hi", max_output_tokens=4)
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    deleted = httpx.delete(f"{server.url}/v1/responses/{response.id}")
    assert deleted.json() == {"id": response.id, "object": "response.deleted", "deleted": True}
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError) as raised:
            call(response.id)
        assert raised.value.body["type"] == "invalid_request_error" and response.id in raised.value.body["message"]
    unstored = create(client, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as raised:
        create(client, input="Hi", previous_response_id=unstored.id)
    assert raised.value.code == "previous_response_not_found" and raised.value.param == "previous_response_id"


def test_continuation_renders_the_stored_conversation_without_its_instructions(server, client):
    first = create(client, input="Hi", instructions="Be brief.", max_output_tokens=6)
    second = create(client, input="And then?", previous_response_id=first.id, max_output_tokens=2)
    assert second.instructions is None
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    assert second.usage.input_tokens == rendered_token_count(server, history)


def test_streamed_responses_are_stored_and_the_oldest_are_dropped(client):
    streamed = stream_events(client, input="Hi", max_output_tokens=2)[-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    newer = [create(client, input="Hi", max_output_tokens=1).id for _ in range(MAX_STORED)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(streamed.id)
    assert all(client.responses.retrieve(i).id == i for i in newer)


def test_store_drops_least_recently_used_within_count_and_byte_caps():
    def response(response_id: str, text: str) -> ResponsesResponse:
        message = MessageItem(id="msg_1", role="assistant", content=[{"type": "output_text", "text": text}])
        return ResponsesResponse(
            id=response_id, status="completed", instructions=None, metadata=None, model="m", output=[message],
            parallel_tool_calls=True, temperature=1.0, tool_choice="auto", tools=[], top_p=1.0,
            max_output_tokens=None, previous_response_id=None, reasoning=None, store=True, text={},
            truncation="disabled", user=None)

    question = [MessageItem(role="user", content="Hi")]
    size = len(response("a", "x").model_dump_json()) + len(question[0].model_dump_json())
    store = ResponseStore(max_items=2, max_bytes=10 * size)
    for response_id in "abc":
        store.put(response(response_id, "x"), question)
    assert store.get("a") is None and len(store) == 2 and store.num_bytes == 2 * size
    store.get("b")  # now the most recently used
    store.put(response("d", "x"), question)
    assert store.get("c") is None and store.get("b").history == [*question, *store.get("b").response.output]
    store = ResponseStore(max_items=10, max_bytes=2 * size + 1)
    for response_id in "abc":
        store.put(response(response_id, "x"), question)
    assert store.get("a") is None and store.get("b") and store.get("c")
    store.put(response("big", "x" * 3 * size), question)
    assert store.get("big") is None and len(store) == 2
    assert store.delete("b") and not store.delete("b") and store.num_bytes == size


# adapters
REASONING_REPLY = 'Paris is asked.</think>Let me check. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'


def built_reply(chunks: list[str]) -> tuple[OutputBuilder, list[dict]]:
    """A reply read by chat's parsers (deepseek_r1 reasoning, Hermes tool calls) chunk by chunk, as items."""
    builder = OutputBuilder()
    tracker = ChatDeltaTracker(ChatOutputParser(reasoning_parser("deepseek_r1"), HermesToolParser()))
    events = []
    for i, chunk in enumerate(chunks):
        delta = tracker.delta(chunk, final=i == len(chunks) - 1)
        events += builder.add(delta) if delta is not None else []
    return builder, events + builder.finish("completed")


def test_reasoning_text_and_calls_become_items_with_the_sdks_events():
    builder, events = built_reply(list(REASONING_REPLY))
    whole, _ = built_reply([REASONING_REPLY])
    without_ids = lambda items: [item.model_dump(exclude={"id", "call_id"}) for item in items]  # noqa: E731
    assert without_ids(builder.items) == without_ids(whole.items)
    reasoning, message, call = builder.items
    assert isinstance(reasoning, ReasoningItem) and reasoning.content[0].text == "Paris is asked."
    assert isinstance(message, MessageItem) and message.content[0].text == "Let me check. "
    assert isinstance(call, FunctionCallItem) and (call.name, json.loads(call.arguments)) == ("f", {"a": 1})
    parsed = [EVENTS.validate_python(event | {"sequence_number": n}) for n, event in enumerate(events)]
    assert [e.type for e in parsed if e.output_index == 0 and "delta" not in e.type] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done"]
    assert "".join(e.delta for e in parsed if e.type == "response.reasoning_text.delta") == "Paris is asked."
    assert "".join(e.delta for e in parsed if e.type == "response.function_call_arguments.delta") == call.arguments
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == [item.model_dump(mode="json") for item in builder.items]
    assert all(item.status == "completed" for item in builder.items)


def test_output_items_passed_back_make_one_assistant_turn():
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "Be kind."}]},
             {"type": "message", "role": "user", "content": "Weather?"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "21"}]
    messages = [m.model_dump(exclude_none=True) for m in chat_messages("Sys", ResponsesRequest(input=items).input)]
    assert messages == [
        {"role": "system", "content": "Sys"}, {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Hm.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "21"}]
