"""A chat reply's text read as a message: reasoning, content and tool calls, whole or as streamed deltas."""
import uuid
from dataclasses import dataclass, field

from inferno.server.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall
from inferno.server.reasoning import ThinkReasoningParser
from inferno.server.tool_parsers import PartialCall, ToolParser


@dataclass(slots=True)
class ParsedMessage:
    reasoning: str
    content: str
    calls: list[PartialCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatOutputParser:
    def __init__(self, reasoning: ThinkReasoningParser | None, tools: ToolParser | None):
        self.reasoning = reasoning
        self.tools = tools

    def parse(self, text: str, final: bool) -> ParsedMessage:
        reasoning, content = self.reasoning.parse(text, final) if self.reasoning else ("", text)
        if self.tools is None:
            return ParsedMessage(reasoning, content, [])
        parsed = self.tools.parse(content, final)
        return ParsedMessage(reasoning, parsed.content, [c for c in parsed.calls if c.name is not None or not final])

    def message_fields(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning_content, content, tool_calls) of a finished reply; content and reasoning None when empty."""
        parsed = self.parse(text, final=True)
        calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in parsed.calls]
        content = parsed.content if parsed.content.strip() or not (calls or parsed.reasoning) else None
        return parsed.reasoning or None, content, calls


@dataclass
class ChatDeltaTracker:
    """What one streamed choice has sent so far; `delta` turns the text so far into the next DeltaMessage."""
    parser: ChatOutputParser
    text: str = ""
    num_reasoning_chars: int = 0
    num_content_chars: int = 0
    call_ids: list[str] = field(default_factory=list)  # one per call whose name was sent
    num_argument_chars: list[int] = field(default_factory=list)

    @property
    def num_calls(self) -> int:
        return len(self.call_ids)

    def delta(self, new_text: str, final: bool) -> DeltaMessage | None:
        self.text += new_text
        parsed = self.parser.parse(self.text, final)
        reasoning = parsed.reasoning[self.num_reasoning_chars:]
        self.num_reasoning_chars += len(reasoning)
        # whitespace alone around tool calls is not sent (the non-streamed message has no content then)
        visible = parsed.content if parsed.content.strip() else ""
        content = visible[self.num_content_chars:]
        self.num_content_chars += len(content)
        tool_calls = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break  # a name is sent first; later calls wait for it
            if index == len(self.call_ids):
                self.call_ids.append(new_call_id())
                self.num_argument_chars.append(0)
                tool_calls.append(DeltaToolCall(index=index, id=self.call_ids[index], type="function",
                                                function=DeltaFunctionCall(name=call.name, arguments="")))
            fragment = call.arguments[self.num_argument_chars[index]:]
            if fragment:
                self.num_argument_chars[index] += len(fragment)
                tool_calls.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment)))
        if not (reasoning or content or tool_calls):
            return None
        return DeltaMessage(reasoning_content=reasoning or None, content=content or None,
                            tool_calls=tool_calls or None)
