"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): the request converted to a chat
completions request at the edge, rendered, constrained and run by chat's path, its reply read by chat's output
parser and returned as Anthropic's message or event stream; errors in Anthropic's shape."""
from collections.abc import AsyncIterator
from functools import partial

from fastapi import Request
from fastapi.responses import Response

from inferno.engine.async_llm import EngineDeadError, RequestFailedError, RequestStream
from inferno.server.chat_output import ChatDeltaTracker
from inferno.server.messages_input import chat_request_of
from inferno.server.messages_output import ContentBlockEvents, content_blocks, sse_event, stop_reason_of
from inferno.server.protocol import ChatCompletionRequest
from inferno.server.protocol_anthropic import (
    AnthropicErrorInfo, AnthropicErrorResponse, CountTokensRequest, CountTokensResponse, MessageResponse,
    MessagesRequest, MessageUsage, ToolUseBlock)
from inferno.server.serving import (
    ChoiceAccumulator, EnginePrompt, EngineStreamingResponse, OpenAIError, cancel_on_disconnect, json_response,
    request_id_of, server_error)
from inferno.server.serving_chat import ServingChat

# Anthropic's error type of each status; the server's 503 (queue full, engine gone) is Anthropic's 529
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}


def is_messages_route(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error_body(error: OpenAIError) -> tuple[int, AnthropicErrorResponse]:
    status = 529 if error.status_code == 503 else error.status_code
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, AnthropicErrorResponse(error=AnthropicErrorInfo(type=kind, message=str(error)))


def anthropic_error_response(error: OpenAIError) -> Response:
    status, body = anthropic_error_body(error)
    return Response(body.model_dump_json(), status_code=status, media_type="application/json")


class ServingMessages:
    """Anthropic's routes in front of the chat completions serving."""

    def __init__(self, chat: ServingChat):
        self.chat = chat

    def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        self.chat.check_model(request.model)
        prompt, _ = self.chat.render(chat_request_of(request))
        return CountTokensResponse(input_tokens=len(prompt.token_ids))

    async def create(self, request: MessagesRequest, raw_request: Request) -> Response:
        lora_request = self.chat.check_model(request.model)  # an unknown model: 404 (in Anthropic's shape)
        chat_request = chat_request_of(request)
        prompt, constraint = self.chat.render(chat_request)
        # max_tokens is required and clients ask for a lot (Claude Code 32000, whatever the model): the answer may
        # use what the context leaves (a prompt alone too long is still a 400, from the engine's checks)
        max_tokens = max(1, min(request.max_tokens, self.chat.max_model_len - len(prompt.token_ids)))
        request_id = f"msg_{request_id_of(raw_request)}"
        params = self.chat.engine_params(chat_request, max_tokens, constraint)
        streams = await self.chat.add_requests(request_id, [prompt], params, lora_request)
        reply = MessageReply(self.chat, request, chat_request, max_tokens < request.max_tokens)
        headers = {"X-Request-Id": request_id, "request-id": request_id}
        if request.stream:
            return EngineStreamingResponse(reply.stream(request_id, prompt, streams[0]),
                                           on_close=partial(self.chat.abort_unfinished, streams), headers=headers)
        try:
            return await cancel_on_disconnect(raw_request, reply.collect(request_id, prompt, streams[0], headers))
        finally:
            self.chat.abort_unfinished(streams)


class MessageReply:
    """One request's reply, read as chat's would be and returned as Anthropic's message or events."""

    def __init__(self, chat: ServingChat, request: MessagesRequest, chat_request: ChatCompletionRequest,
                 cut_to_context: bool):
        self.model_name = request.model  # the base model's name or an adapter's
        self.parser = chat.output_parser(chat_request)
        self.thinking = request.thinking is not None and request.thinking.enabled
        choice = request.tool_choice
        self.max_tool_uses = 1 if choice is not None and choice.disable_parallel_tool_use else None
        self.cut_to_context = cut_to_context

    async def collect(self, request_id: str, prompt: EnginePrompt, stream: RequestStream,
                      headers: dict[str, str]) -> Response:
        reply = ChoiceAccumulator()
        try:
            async for output in stream:
                reply.add(output.outputs[0])
        except (RequestFailedError, EngineDeadError) as e:
            raise server_error(str(e)) from e
        blocks = content_blocks(self.parser.parse(reply.text, final=True), self.thinking, self.max_tool_uses)
        has_tool_use = any(isinstance(b, ToolUseBlock) for b in blocks)
        stop_reason, stop_sequence = stop_reason_of(reply.finish_reason, reply.stop_reason, has_tool_use,
                                                    self.cut_to_context)
        message = MessageResponse(id=request_id, model=self.model_name, content=blocks, stop_reason=stop_reason,
                                  stop_sequence=stop_sequence,
                                  usage=MessageUsage(input_tokens=len(prompt.token_ids),
                                                     output_tokens=len(reply.token_ids)))
        return json_response(message, headers)

    async def stream(self, request_id: str, prompt: EnginePrompt, stream: RequestStream) -> AsyncIterator[str]:
        start = MessageResponse(id=request_id, model=self.model_name, content=[],
                                usage=MessageUsage(input_tokens=len(prompt.token_ids), output_tokens=0))
        yield sse_event({"type": "message_start", "message": start.model_dump()})
        yield sse_event({"type": "ping"})
        tracker = ChatDeltaTracker(self.parser)
        blocks = ContentBlockEvents(self.thinking, self.max_tool_uses)
        num_output_tokens, finish_reason, stop_reason = 0, None, None
        try:
            async for output in stream:
                completion = output.outputs[0]
                num_output_tokens += len(completion.token_ids)
                finish_reason, stop_reason = completion.finish_reason, completion.stop_reason
                delta = tracker.delta(completion.text, finish_reason is not None)
                for event in blocks.events(delta) if delta is not None else []:
                    yield event
        except (RequestFailedError, EngineDeadError) as e:
            yield sse_event(anthropic_error_body(server_error(str(e)))[1].model_dump())
            return
        for event in blocks.finish():
            yield event
        stop_reason, stop_sequence = stop_reason_of(finish_reason, stop_reason, blocks.num_tool_uses > 0,
                                                    self.cut_to_context)
        yield sse_event({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                         "usage": {"input_tokens": len(prompt.token_ids), "output_tokens": num_output_tokens}})
        yield sse_event({"type": "message_stop"})
