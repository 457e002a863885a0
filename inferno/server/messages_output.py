"""A chat reply as Anthropic's message: the parsed reply (reasoning, text, tool calls) as content blocks, whole or
as the content block events of a stream, and the stop reason."""
import json
import uuid
from typing import Any

from inferno.server.chat_output import ParsedMessage
from inferno.server.protocol import DeltaMessage
from inferno.server.protocol_anthropic import ContentBlock, TextBlock, ThinkingBlock, ToolUseBlock


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is; {} when the model wrote no JSON object."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(parsed: ParsedMessage, thinking: bool, max_tool_uses: int | None) -> list[ContentBlock]:
    """The blocks of a finished reply, as the stream's events add them up: no text block for whitespace alone, and
    none of the whitespace before and between tool calls."""
    blocks: list[ContentBlock] = []
    if thinking and parsed.reasoning:
        blocks.append(ThinkingBlock(thinking=parsed.reasoning))
    calls = parsed.calls[:max_tool_uses]
    if parsed.content.strip():
        blocks.append(TextBlock(text=parsed.content.rstrip() if calls else parsed.content))
    for call in calls:
        blocks.append(ToolUseBlock(id=new_tool_use_id(), name=call.name, input=tool_input(call.arguments)))
    return blocks


def stop_reason_of(finish_reason: str | None, stop_reason: int | str | None, has_tool_use: bool,
                   cut_to_context: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply; `cut_to_context`: max_tokens was lowered to the context
    left, so a length stop is the context's end, Anthropic's model_context_window_exceeded."""
    if finish_reason == "length":
        return ("model_context_window_exceeded" if cut_to_context else "max_tokens"), None
    if has_tool_use:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def sse_event(data: dict[str, Any]) -> str:
    """An Anthropic server-sent event: its type in the `event:` line and in the data."""
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class ContentBlockEvents:
    """Content block events from a chat stream's DeltaMessages: a block starts when the kind of delta changes
    (thinking, text, each tool call) and stops when the next one starts or the reply ends. Whitespace at the end
    of the text so far waits: it is sent with more text or when the reply ends in the text, not before another
    block."""

    def __init__(self, thinking: bool, max_tool_uses: int | None):
        self.thinking = thinking
        self.max_tool_uses = max_tool_uses
        self.index = -1
        self.open_kind: str | None = None  # "thinking", "text" or "tool_use:<call index>"
        self.num_tool_uses = 0
        self.pending_space = ""

    def events(self, delta: DeltaMessage) -> list[str]:
        events = []
        if delta.reasoning_content and self.thinking:
            events += self.start("thinking", ThinkingBlock(thinking=""))
            events.append(self.delta({"type": "thinking_delta", "thinking": delta.reasoning_content}))
        if delta.content:
            text = self.pending_space + delta.content
            body = text.rstrip()
            if body:
                events += self.start("text", TextBlock(text=""))
                events.append(self.delta({"type": "text_delta", "text": body}))
            self.pending_space = text[len(body):]
        for call in delta.tool_calls or []:
            if self.max_tool_uses is not None and call.index >= self.max_tool_uses:
                continue
            if call.id is not None:  # the call's first delta, with its name
                self.num_tool_uses += 1
                events += self.start(f"tool_use:{call.index}",
                                     ToolUseBlock(id=new_tool_use_id(), name=call.function.name, input={}))
            if call.function.arguments:
                events.append(self.delta({"type": "input_json_delta", "partial_json": call.function.arguments}))
        return events

    def start(self, kind: str, block: ContentBlock) -> list[str]:
        if kind == self.open_kind:
            return []
        events = self.stop()
        self.pending_space = ""  # whitespace before another block is not sent
        self.index += 1
        self.open_kind = kind
        return events + [sse_event({"type": "content_block_start", "index": self.index,
                                    "content_block": block.model_dump()})]

    def delta(self, delta: dict[str, Any]) -> str:
        return sse_event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def finish(self) -> list[str]:
        """The events that end the reply."""
        if self.open_kind == "text" and self.pending_space:
            return [self.delta({"type": "text_delta", "text": self.pending_space})] + self.stop()
        return self.stop()

    def stop(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [sse_event({"type": "content_block_stop", "index": self.index})]
