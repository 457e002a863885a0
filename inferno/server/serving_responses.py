"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over chat completions' machinery
(the request adapted by responses_input, the reply read by chat's parsers and built into items by
responses_output), with stored responses for `previous_response_id`."""
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

from fastapi import Request
from fastapi.responses import Response

from inferno.engine.async_llm import EngineDeadError, RequestFailedError, RequestStream
from inferno.server.chat_output import ChatDeltaTracker, ChatOutputParser
from inferno.server.protocol_responses import (
    DeletedResponse, IncompleteDetails, InputItem, OutputItem, ReasoningItem, ResponseError, ResponseStatus,
    ResponsesRequest, ResponsesResponse, ResponseUsage)
from inferno.server.response_store import ResponseStore
from inferno.server.responses_input import chat_request, input_items, responses_params
from inferno.server.responses_output import Event, OutputBuilder
from inferno.server.serving import (
    ChoiceAccumulator, EnginePrompt, EngineStreamingResponse, OpenAIError, cancel_on_disconnect, json_response,
    request_id_of, server_error)
from inferno.server.serving_chat import ServingChat


@dataclass(slots=True)
class PendingResponse:
    """A request on its way to becoming a response: what the response object echoes and what the store keeps."""
    request: ResponsesRequest
    id: str
    model: str
    prompt: EnginePrompt
    conversation: list[InputItem]  # previous_response_id's history, then this request's input
    parser: ChatOutputParser
    created_at: int

    def response(self, status: ResponseStatus, output: list[OutputItem], usage: ResponseUsage | None = None,
                 error: ResponseError | None = None) -> ResponsesResponse:
        request = self.request
        return ResponsesResponse(
            id=self.id, created_at=self.created_at, status=status, error=error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=request.instructions, metadata=request.metadata, model=self.model, output=output,
            parallel_tool_calls=request.parallel_tool_calls,
            temperature=1.0 if request.temperature is None else request.temperature,
            tool_choice=request.tool_choice, tools=request.tools, top_p=1.0 if request.top_p is None else request.top_p,
            max_output_tokens=request.max_output_tokens, previous_response_id=request.previous_response_id,
            reasoning=request.reasoning, store=request.store, text=request.text, truncation=request.truncation,
            usage=usage, user=request.user)


class ServingResponses:
    def __init__(self, chat: ServingChat, store: ResponseStore):
        self.chat = chat
        self.store = store

    async def create(self, request: ResponsesRequest, raw_request: Request) -> Response:
        if request.background:
            raise OpenAIError("background mode is not supported: leave `background` out or set it to false",
                              param="background")
        lora_request = self.chat.check_model(request.model)
        conversation = [*self.history(request.previous_response_id), *input_items(request.input)]
        response_id = f"resp_{request_id_of(raw_request)}"
        with responses_params():
            chat = chat_request(request, conversation)
            prompt, params = self.chat.prepare(chat)
            pending = PendingResponse(request, response_id, self.chat.models.model_name(lora_request), prompt,
                                      conversation, self.chat.output_parser(chat), int(time.time()))
            streams = await self.chat.add_requests(response_id, [prompt], params, lora_request)
        headers = {"X-Request-Id": response_id}
        if request.stream:
            return EngineStreamingResponse(self.stream(pending, streams[0]),
                                           on_close=partial(self.chat.abort_unfinished, streams), headers=headers)
        try:
            return await cancel_on_disconnect(raw_request, self.collect(pending, streams[0], headers))
        finally:
            self.chat.abort_unfinished(streams)

    def history(self, previous_response_id: str | None) -> list[InputItem]:
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise OpenAIError(f"Previous response with id '{previous_response_id}' not found.",
                              param="previous_response_id", code="previous_response_not_found")
        return stored.history

    def retrieve(self, response_id: str) -> ResponsesResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise response_not_found(response_id)
        return stored.response

    def delete(self, response_id: str) -> DeletedResponse:
        if not self.store.delete(response_id):
            raise response_not_found(response_id)
        return DeletedResponse(id=response_id)

    async def collect(self, pending: PendingResponse, stream: RequestStream, headers: dict[str, str]) -> Response:
        reply = ChoiceAccumulator()
        try:
            async for output in stream:
                for completion in output.outputs:
                    reply.add(completion)
        except (RequestFailedError, EngineDeadError) as e:
            raise server_error(str(e)) from e
        builder = OutputBuilder()
        delta = ChatDeltaTracker(pending.parser).delta(reply.text, final=True)
        if delta is not None:
            builder.add(delta)
        status = status_of(reply.finish_reason)
        builder.finish("incomplete" if status == "incomplete" else "completed")
        response = self.finished(pending, status, builder.items, len(reply.token_ids))
        return json_response(response, headers)

    async def stream(self, pending: PendingResponse, stream: RequestStream) -> AsyncIterator[str]:
        sequence_numbers = itertools.count()

        def sse(event: Event) -> str:
            event["sequence_number"] = next(sequence_numbers)
            return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

        started = pending.response("in_progress", []).model_dump(mode="json")
        yield sse({"type": "response.created", "response": started})
        yield sse({"type": "response.in_progress", "response": started})
        builder, tracker = OutputBuilder(), ChatDeltaTracker(pending.parser)
        num_output_tokens, finish_reason = 0, None
        try:
            async for output in stream:
                for completion in output.outputs:
                    num_output_tokens += len(completion.token_ids)
                    finish_reason = completion.finish_reason
                    delta = tracker.delta(completion.text, finish_reason is not None)
                    for event in builder.add(delta) if delta is not None else []:
                        yield sse(event)
        except (RequestFailedError, EngineDeadError) as e:
            yield sse({"type": "error", "code": "server_error", "message": str(e), "param": None})
            for event in builder.finish("incomplete"):
                yield sse(event)
            failed = self.finished(pending, "failed", builder.items, num_output_tokens,
                                   ResponseError(message=str(e)))
            yield sse({"type": "response.failed", "response": failed.model_dump(mode="json")})
            return
        status = status_of(finish_reason)
        for event in builder.finish("incomplete" if status == "incomplete" else "completed"):
            yield sse(event)
        response = self.finished(pending, status, builder.items, num_output_tokens)
        yield sse({"type": f"response.{status}", "response": response.model_dump(mode="json")})

    def finished(self, pending: PendingResponse, status: ResponseStatus, output: list[OutputItem],
                 num_output_tokens: int, error: ResponseError | None = None) -> ResponsesResponse:
        """The final response object, kept in the store when the request asked for it."""
        response = pending.response(status, output, self.usage(pending.prompt, output, num_output_tokens), error)
        if pending.request.store:
            self.store.put(response, pending.conversation)
        return response

    def usage(self, prompt: EnginePrompt, output: list[OutputItem], num_output_tokens: int) -> ResponseUsage:
        reasoning = "".join(part.text for item in output if isinstance(item, ReasoningItem) for part in item.content)
        num_reasoning_tokens = len(self.chat.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        num_input_tokens = len(prompt.token_ids)
        return ResponseUsage(input_tokens=num_input_tokens, output_tokens=num_output_tokens,
                             output_tokens_details={"reasoning_tokens": min(num_reasoning_tokens, num_output_tokens)},
                             total_tokens=num_input_tokens + num_output_tokens)


def status_of(finish_reason: str | None) -> ResponseStatus:
    """A reply cut by its token limit is incomplete; one that stopped by itself is completed."""
    return "incomplete" if finish_reason == "length" else "completed"


def response_not_found(response_id: str) -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", status_code=404)
