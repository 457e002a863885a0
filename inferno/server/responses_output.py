"""A reply read by chat's parsers (its DeltaMessages) as Responses output items, with the stream events that open,
grow and close each item. A non-streamed reply goes through the same builder in one delta, so streamed and
non-streamed replies give the same items."""
import uuid
from typing import Any

from inferno.server.protocol import DeltaMessage, DeltaToolCall
from inferno.server.protocol_responses import (
    FunctionCallItem, ItemStatus, MessageItem, OutputItem, OutputText, ReasoningItem, ReasoningText)

Event = dict[str, Any]  # a stream event without its sequence_number


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self):
        self.items: list[OutputItem] = []
        self.open_item: OutputItem | None = None
        self.calls: list[FunctionCallItem] = []  # by the tool call's index in the reply

    def add(self, delta: DeltaMessage) -> list[Event]:
        events = []
        if delta.reasoning_content:
            events += self.add_reasoning(delta.reasoning_content)
        if delta.content:
            events += self.add_text(delta.content)
        for call in delta.tool_calls or []:
            events += self.add_call(call)
        return events

    def finish(self, status: ItemStatus) -> list[Event]:
        """Close the last item with `status`; a reply with no item at all gets an empty message."""
        events = [] if self.items else self.start(new_message(), OutputText(text=""))
        return events + self.close(status)

    # deltas
    def add_reasoning(self, text: str) -> list[Event]:
        events = [] if isinstance(self.open_item, ReasoningItem) else self.start(
            ReasoningItem(id=new_item_id("rs"), content=[], status="in_progress"), ReasoningText(text=""))
        self.open_item.content[0].text += text
        return events + [self.event("response.reasoning_text.delta", content_index=0, delta=text)]

    def add_text(self, text: str) -> list[Event]:
        events = [] if isinstance(self.open_item, MessageItem) else self.start(new_message(), OutputText(text=""))
        self.open_item.content[0].text += text
        return events + [self.event("response.output_text.delta", content_index=0, delta=text, logprobs=[])]

    def add_call(self, call: DeltaToolCall) -> list[Event]:
        events = []
        if call.id is not None:  # a call starts with its id and name
            item = FunctionCallItem(id=new_item_id("fc"), call_id=call.id, name=call.function.name, arguments="",
                                    status="in_progress")
            self.calls.append(item)
            events += self.start(item)
        if call.function.arguments:
            item = self.calls[call.index]
            assert item is self.open_item, "chat's parsers finish a call's arguments before the next call starts"
            item.arguments += call.function.arguments
            events.append(self.event("response.function_call_arguments.delta", delta=call.function.arguments))
        return events

    # items
    def start(self, item: OutputItem, part: OutputText | ReasoningText | None = None) -> list[Event]:
        events = self.close("completed")
        self.items.append(item)
        self.open_item = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": item.model_dump(mode="json")})
        if part is not None:
            item.content.append(part)
            events.append(self.event("response.content_part.added", content_index=0, part=part.model_dump(mode="json")))
        return events

    def close(self, status: ItemStatus) -> list[Event]:
        item = self.open_item
        if item is None:
            return []
        if isinstance(item, FunctionCallItem):
            events = [self.event("response.function_call_arguments.done", name=item.name, arguments=item.arguments)]
        else:
            part = item.content[0]
            done = "response.output_text.done" if isinstance(item, MessageItem) else "response.reasoning_text.done"
            extra = {"logprobs": []} if isinstance(item, MessageItem) else {}
            events = [self.event(done, content_index=0, text=part.text, **extra),
                      self.event("response.content_part.done", content_index=0, part=part.model_dump(mode="json"))]
        item.status = status
        events.append({"type": "response.output_item.done", "output_index": len(self.items) - 1,
                       "item": item.model_dump(mode="json")})
        self.open_item = None
        return events

    def event(self, type: str, **fields: Any) -> Event:
        return {"type": type, "item_id": self.open_item.id, "output_index": len(self.items) - 1, **fields}


def new_message() -> MessageItem:
    return MessageItem(id=new_item_id("msg"), role="assistant", content=[], status="in_progress")
