"""Tool-call and reasoning parsers: streamed deltas (fed in any split) add up to the non-streamed message, names come
before their arguments, and no markup reaches the client."""
import json

import pytest

from inferno.server.chat_output import ChatDeltaTracker, ChatOutputParser
from inferno.server.reasoning import reasoning_parser
from inferno.server.tool_parsers import (
    HermesToolParser, Llama3JsonToolParser, NamedToolParser, RequiredToolParser, tool_parser_for_template)

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET \\"x\\" {}"}}\n</tool_call>')
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```'
THINK = "<think>The user wants weather.\nCall the tool.</think>\n\n" + HERMES


def stream(parser: ChatOutputParser, text: str, step: int):
    """Feed `text` in pieces of `step` characters; returns (reasoning, content, calls) assembled from the deltas and
    the deltas themselves."""
    tracker, deltas = ChatDeltaTracker(parser), []
    for i in range(0, len(text), step):
        delta = tracker.delta(text[i:i + step], final=i + step >= len(text))
        if delta is not None:
            deltas.append(delta)
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for call in d.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
            if call.function.name is not None:
                assert entry["name"] is None and entry["arguments"] == "", "the name comes first, once"
                entry["name"] = call.function.name
            entry["arguments"] += call.function.arguments or ""
    return reasoning, content, [calls[i] for i in sorted(calls)], deltas


@pytest.mark.parametrize("parser, text", [
    (ChatOutputParser(None, HermesToolParser()), HERMES),
    (ChatOutputParser(None, Llama3JsonToolParser()), LLAMA3),
    (ChatOutputParser(None, RequiredToolParser()), REQUIRED),
    (ChatOutputParser(None, NamedToolParser("get_weather")), '{"city": "Paris"}'),
    (ChatOutputParser(reasoning_parser("deepseek_r1"), HermesToolParser()), THINK),
    (ChatOutputParser(reasoning_parser("qwen3"), None), "<think>hmm</think>\n\nThe answer is 4."),
    (ChatOutputParser(None, HermesToolParser()), "No tools needed: 2 < 3 and <tool is fine."),
    (ChatOutputParser(None, HermesToolParser()), ' {"name": "get_time", "arguments": {"tz": "UTC"}}'),
    (ChatOutputParser(None, HermesToolParser()), FENCED),
    (ChatOutputParser(None, HermesToolParser()), "```python\nprint('not a call')\n```"),
])
@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_deltas_add_up_to_the_whole_message(parser, text, step):
    reasoning, content, calls = parser.message_fields(text)
    streamed_reasoning, streamed_content, streamed_calls, deltas = stream(parser, text, step)
    assert streamed_reasoning == (reasoning or "")
    assert streamed_content == (content or "")
    assert streamed_calls == [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]
    for d in deltas:
        for piece in (d.content or "", d.reasoning_content or ""):
            assert "<tool_call" not in piece and "</think" not in piece and "<|python_tag" not in piece


def test_hermes_calls_and_content():
    reasoning, content, calls = ChatOutputParser(None, HermesToolParser()).message_fields(HERMES)
    assert content.strip() == "Let me check." and reasoning is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": 'CET "x" {}'})]


def test_reasoning_is_split_from_the_content():
    reasoning, content, calls = ChatOutputParser(reasoning_parser("deepseek_r1"), HermesToolParser()).message_fields(
        THINK)
    assert reasoning == "The user wants weather.\nCall the tool." and len(calls) == 2
    assert reasoning_parser("qwen3").parse("No thinking here.", final=True) == ("", "No thinking here.")


def test_parser_is_chosen_from_the_chat_template():
    assert tool_parser_for_template("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tool_parser_for_template("<|python_tag|>{{ m }}") == "llama3_json"
    assert tool_parser_for_template("{{ messages }}") is None


def test_a_fenced_reply_of_call_objects_is_calls_and_other_code_is_content():
    parser = ChatOutputParser(None, HermesToolParser())
    reasoning, content, calls = parser.message_fields(FENCED)
    assert not content and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    code = "```python\nprint('not a call')\n```"
    assert parser.message_fields(code)[1:] == (code, [])
