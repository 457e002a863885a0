"""Stored responses (`store: true`) for GET / DELETE /v1/responses/{id} and `previous_response_id`: in memory,
least recently used first out, bounded by a count and by the bytes of their JSON."""
from collections import OrderedDict
from dataclasses import dataclass

from inferno.server.protocol_responses import InputItem, ResponsesResponse


@dataclass(slots=True)
class StoredResponse:
    response: ResponsesResponse
    conversation: list[InputItem]  # the input items it answered, those of the responses it continued included
    num_bytes: int

    @property
    def history(self) -> list[InputItem]:
        """What a continuation renders before its own input: the conversation and this response's output."""
        return [*self.conversation, *self.response.output]


class ResponseStore:
    def __init__(self, max_items: int, max_bytes: int):
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponsesResponse, conversation: list[InputItem]) -> None:
        """Keep `response`, dropping the least recently used ones beyond the caps (one larger than the byte cap
        alone is not kept)."""
        self.delete(response.id)
        num_bytes = len(response.model_dump_json()) + sum(len(item.model_dump_json()) for item in conversation)
        if num_bytes > self.max_bytes or self.max_items == 0:
            return
        while self._entries and (len(self._entries) >= self.max_items or
                                 self.num_bytes + num_bytes > self.max_bytes):
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes
        self._entries[response.id] = StoredResponse(response, conversation, num_bytes)
        self.num_bytes += num_bytes

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes
        return entry is not None
