"""What the OpenAI endpoints share: errors, checks, prompts, handing requests to AsyncLLM, SSE, disconnects."""
import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from inferno.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from inferno.lora_request import LoRARequest
from inferno.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from inferno.pooling_params import PoolingParams
from inferno.sampling_params import SamplingParams, StructuredOutputsParams
from inferno.server.protocol import ChatMessage, ErrorInfo, ErrorResponse, SamplingRequest, UsageInfo

if TYPE_CHECKING:  # serving_models raises this module's OpenAIError
    from inferno.server.serving_models import ServingModels

SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)} | {"response_format"}  # names a ValueError may start with
MIN_LOGPROB = -9999.0  # JSON has no -inf


class OpenAIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, message: str, status_code: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    @property
    def body(self) -> ErrorResponse:
        return ErrorResponse(error=self.info)

    def response(self) -> Response:
        return Response(self.body.model_dump_json(), status_code=self.status_code, media_type="application/json")


def server_error(message: str) -> OpenAIError:
    return OpenAIError(message, status_code=500, type="server_error")


@dataclass(slots=True)
class EnginePrompt:
    text: str | None
    token_ids: list[int]


@dataclass
class ChoiceAccumulator:
    """One choice of a non-streamed response, put together from DELTA outputs."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, completion: CompletionOutput) -> None:
        self.text += completion.text
        self.token_ids.extend(completion.token_ids)
        self.logprobs.extend(completion.logprobs or [])
        self.finish_reason = completion.finish_reason
        self.stop_reason = completion.stop_reason


def request_id_of(raw_request: Request) -> str:
    """The client's X-Request-Id, or a fresh one."""
    return raw_request.headers.get("x-request-id") or uuid.uuid4().hex


def usage_of(prompts: list[EnginePrompt], num_completion_tokens: int) -> UsageInfo:
    num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                     total_tokens=num_prompt_tokens + num_completion_tokens)


def clamp_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf and NaN become MIN_LOGPROB."""
    return min(value, 0.0) if value > MIN_LOGPROB else MIN_LOGPROB


def json_response(body: BaseModel, headers: dict[str, str] | None = None) -> Response:
    return Response(body.model_dump_json(), media_type="application/json", headers=headers)


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json(exclude_none=True)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class OpenAIServing:
    def __init__(self, async_llm: AsyncLLM, models: "ServingModels"):
        self.async_llm = async_llm
        self.models = models
        self.tokenizer = async_llm.tokenizer
        self.input_processor = async_llm.engine.input_processor  # what every request passes through
        self.max_model_len = async_llm.max_model_len
        self.vocab_size = async_llm.engine.model_config.vocab_size

    # checks
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter the request's `model` names (None: the base model); 404 for a name not served."""
        return self.models.lora_request(model)

    def check_sampling(self, request: SamplingRequest) -> None:
        if request.logit_bias:
            raise OpenAIError("logit_bias is not supported", param="logit_bias")

    def check_length(self, prompt: EnginePrompt, max_tokens: int | None, param: str) -> None:
        try:
            self.input_processor.check_fits(len(prompt.token_ids), max_tokens, param)
        except ValueError as e:
            raise OpenAIError(str(e), param=param) from e

    def sampling_params(self, request: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        try:
            params = request.sampling_params(max_tokens, logprobs, prompt_logprobs, structured_outputs)
            self.input_processor.check_params(params)
            return params
        except ValueError as e:
            raise invalid_request(e) from e

    # prompts
    def encode(self, text: str) -> EnginePrompt:
        return EnginePrompt(*self.input_processor.tokenize(text))

    def prompts(self, prompt: str | list[str] | list[int] | list[list[int]], param: str) -> list[EnginePrompt]:
        """A text, texts, token ids or lists of them (the body's field `param`), as the completions and embeddings
        routes take them."""
        if isinstance(prompt, str):
            return [self.encode(prompt)]
        if not prompt:
            raise OpenAIError(f"{param} must not be empty", param=param)
        if isinstance(prompt[0], int):
            return [EnginePrompt(None, list(prompt))]
        return [self.encode(p) if isinstance(p, str) else EnginePrompt(None, list(p)) for p in prompt]

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> EnginePrompt:
        conversation = [template_message(m) for m in messages]
        try:
            prompt = self.input_processor.render_chat(conversation, add_generation_prompt, tools, chat_template_kwargs)
        except Exception as e:  # template errors come from the messages the client sent
            raise OpenAIError(f"could not render the chat template: {e}", param="messages") from e
        return EnginePrompt(prompt["prompt"], prompt["prompt_token_ids"])

    # engine
    async def add_requests(self, request_id: str, prompts: list[EnginePrompt], params: SamplingParams | PoolingParams,
                           lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """One engine request per prompt (`{request_id}-{i}` when there are several), run with `lora_request`'s
        adapter if given; all or none."""
        if self.async_llm.is_overloaded:
            raise OpenAIError("The server is overloaded: the waiting queue is full. Please retry later.",
                              status_code=503, type="server_error", code="engine_overloaded")
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                engine_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                engine_prompt = {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}
                streams.append(await self.async_llm.add_request(engine_id, engine_prompt, params,
                                                                lora_request=lora_request))
        except ValueError as e:
            self.abort_unfinished(streams)
            raise invalid_request(e) from e
        except EngineDeadError as e:
            self.abort_unfinished(streams)
            raise OpenAIError(str(e), status_code=503, type="server_error") from e
        except BaseException:
            self.abort_unfinished(streams)
            raise
        return streams

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.async_llm.abort(stream.request_id)


def invalid_request(error: ValueError) -> OpenAIError:
    """A 400 for a ValueError of SamplingParams or the input processor (they name the field first)."""
    name = str(error).split(" ", 1)[0]
    return OpenAIError(str(error), param=name if name in SAMPLING_FIELDS else None)


def template_message(message: ChatMessage) -> dict:
    """A message as chat templates expect it: text content parts joined into one string."""
    rendered = message.model_dump(exclude_none=True)
    for call in rendered.get("tool_calls") or []:  # templates read the arguments as a mapping, as transformers does
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            with suppress(json.JSONDecodeError):
                function["arguments"] = json.loads(function["arguments"])
    if isinstance(message.content, list):
        texts = []
        for part in message.content:
            if part.type != "text" or part.text is None:
                raise OpenAIError(f"content parts of type {part.type!r} are not supported; send text",
                                  param="messages")
            texts.append(part.text)
        rendered["content"] = "\n".join(texts)
    return rendered


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they arrive, with the index of the stream each came from."""
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, output
    finally:
        for task in pending:
            task.cancel()


async def cancel_on_disconnect(raw_request: Request, handler: Awaitable[Response]) -> Response:
    """Run a non-streaming handler; when the client disconnects first, cancel it (its cleanup aborts)."""
    work = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            with suppress(asyncio.CancelledError):
                await work
    if work in done:
        return work.result()
    return Response(status_code=499)  # nobody is listening; nginx's "client closed request"


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


class EngineStreamingResponse(StreamingResponse):
    """Server-sent events that call `on_close` however the response ends: done, client gone, or error."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str]):
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
