"""Tool calls in a chat model's text: Hermes / Qwen2.5 (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`)
and Llama 3.x JSON (`{"name": ..., "parameters": {...}}`, several separated by `;`).

A parser reads the whole text so far and returns the content around the calls and each call's name and raw
argument text so far. The result only grows as the text grows (text that may still become markup is held back
until it is decided), so streaming sends the difference between two parses and the deltas add up to the
non-streamed result.
"""
import re
from dataclasses import dataclass, field

NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*(?=\S)')


@dataclass(slots=True)
class PartialCall:
    name: str | None  # None until the name's string is complete
    arguments: str  # the raw JSON text of the arguments so far
    complete: bool  # the arguments' JSON value is closed


@dataclass(slots=True)
class ParsedTools:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


def json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array starting at text[start], None while it is not closed."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def partial_call(obj: str) -> PartialCall:
    """A call from the text of its JSON object `{"name": ..., "arguments": ...}` (possibly unfinished)."""
    args = ARGUMENTS.search(obj)
    head = obj[:args.start()] if args else obj
    name = NAME.search(head)
    if args is None:
        return PartialCall(name.group(1) if name else None, "", False)
    end = json_value_end(obj, args.end())
    return PartialCall(name.group(1) if name else None, obj[args.end():end], end is not None)


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (it may still become the marker)."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


def json_calls(text: str) -> list[PartialCall]:
    """Consecutive call objects, optionally inside `[...]` and separated by `,` or `;`."""
    calls, pos = [], 0
    while pos < len(text):
        if text[pos] in " \t\r\n,;[]":
            pos += 1
            continue
        if text[pos] != "{":
            break
        end = json_value_end(text, pos)
        calls.append(partial_call(text[pos:end]))
        if end is None:
            break
        pos = end
    return calls


class HermesToolParser:
    """Qwen2.5, Hermes and similar templates: calls wrapped in <tool_call> tags, text around them is content. Small
    models often leave the tags out: a reply that is bare call objects counts as calls too, and so does one that is
    call objects in a code fence (```json ... ```, as Qwen2.5-Coder writes them about as often)."""
    START, END = "<tool_call>", "</tool_call>"
    FENCE = re.compile(r"```(?:json)?[ \t]*\n?\s*")

    def parse(self, text: str, final: bool) -> ParsedTools:
        body = text.lstrip()
        fence = self.FENCE.match(body)
        if fence and body.startswith("{", fence.end()):
            return ParsedTools("", json_calls(body[fence.end():]))
        if body.startswith("{"):
            return ParsedTools("", json_calls(body))
        if not final and (not body or "```json".startswith(body) or (fence and fence.end() == len(body))):
            return ParsedTools("")  # may still become calls
        parsed, pos = ParsedTools(""), 0
        while True:
            start = text.find(self.START, pos)
            if start == -1:
                tail = text[pos:]
                parsed.content += tail if final else tail[:len(tail) - held_back(tail, self.START)]
                return parsed
            parsed.content += text[pos:start]
            body_start = start + len(self.START)
            end = text.find(self.END, body_start)
            body = text[body_start:] if end == -1 else text[body_start:end]
            if "{" in body:
                parsed.calls.append(partial_call(body[body.index("{"):]))
            if end == -1:
                return parsed
            pos = end + len(self.END)


class Llama3JsonToolParser:
    """Llama 3.x: a reply that is JSON (after an optional <|python_tag|>) is one or more calls, else content."""
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParsedTools:
        body = text.lstrip()
        body = body.removeprefix(self.PYTHON_TAG).lstrip()
        if not body:
            return ParsedTools(text if final else "")
        if not final and self.PYTHON_TAG.startswith(body):
            return ParsedTools("")
        if body[0] not in "{[":
            return ParsedTools(text)
        return ParsedTools("", json_calls(body))


class NamedToolParser:
    """tool_choice naming a function: the whole (constrained) output is its arguments."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedTools:
        return ParsedTools("", [PartialCall(self.name, text, json_value_end(text, 0) is not None)])


class RequiredToolParser:
    """tool_choice "required": the (constrained) output is a JSON array of {"name", "parameters"} objects."""

    def parse(self, text: str, final: bool) -> ParsedTools:
        return ParsedTools("", json_calls(text))


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
ToolParser = HermesToolParser | Llama3JsonToolParser | NamedToolParser | RequiredToolParser


def tool_parser_for_template(chat_template: str | None) -> str | None:
    """The parser a chat template's tool-call format needs, when it has one."""
    if chat_template is None:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template:
        return "llama3_json"
    return None
