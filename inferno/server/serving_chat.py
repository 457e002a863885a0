"""POST /v1/chat/completions: messages rendered with the model's chat template, one engine request."""
import time
from collections.abc import AsyncIterator
from functools import partial

from fastapi import Request
from fastapi.responses import Response

from inferno.engine.async_llm import EngineDeadError, RequestFailedError, RequestStream
from inferno.outputs import Logprob, PositionLogprobs
from inferno.server.protocol import (
    AssistantMessage, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
    ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChoiceLogprobs, DeltaMessage, TokenLogprob, TopLogprob)
from inferno.server.serving import (
    SSE_DONE, ChoiceAccumulator, EnginePrompt, EngineStreamingResponse, OpenAIError, OpenAIServing,
    cancel_on_disconnect, clamp_logprob, json_response, request_id_of, server_error, sse, usage_of)


class ServingChat(OpenAIServing):
    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.check_sampling(request)
        self.check_chat_options(request)
        prompt = self.chat_prompt(request.messages, request.add_generation_prompt, request.tools,
                                  request.chat_template_kwargs)
        max_tokens = request.max_completion_tokens or request.max_tokens
        self.check_length(prompt, max_tokens, "max_completion_tokens")
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, num_logprobs)
        request_id = f"chatcmpl-{request_id_of(raw_request)}"
        streams = await self.add_requests(request_id, [prompt], params)
        headers = {"X-Request-Id": request_id}
        if request.stream:
            return EngineStreamingResponse(self.stream(request, request_id, prompt, streams[0]),
                                           on_close=partial(self.abort_unfinished, streams), headers=headers)
        try:
            return await cancel_on_disconnect(raw_request,
                                              self.collect(request, request_id, prompt, streams[0], headers))
        finally:
            self.abort_unfinished(streams)

    @staticmethod
    def check_chat_options(request: ChatCompletionRequest) -> None:
        if request.top_logprobs and not request.logprobs:
            raise OpenAIError("logprobs must be true when top_logprobs is set", param="top_logprobs")
        if request.response_format is not None and request.response_format.type != "text":
            raise OpenAIError(f"response_format {request.response_format.type!r} is not supported; only 'text'",
                              param="response_format")
        if request.tool_choice not in (None, "none", "auto"):
            raise OpenAIError("tool_choice other than 'none' or 'auto' is not supported", param="tool_choice")

    def logprobs(self, token_ids: list[int], positions: list[PositionLogprobs], num_top: int) -> ChoiceLogprobs:
        content = []
        for token_id, position in zip(token_ids, positions):
            top = sorted(((t, lp) for t, lp in position.items() if lp.rank <= num_top), key=lambda e: e[1].rank)
            content.append(TokenLogprob(**self.token_logprob(token_id, position[token_id]),
                                        top_logprobs=[TopLogprob(**self.token_logprob(t, lp)) for t, lp in top]))
        return ChoiceLogprobs(content=content)

    def token_logprob(self, token_id: int, logprob: Logprob) -> dict:
        token = logprob.decoded_token if logprob.decoded_token is not None else self.tokenizer.id_to_token(token_id)
        return {"token": token, "logprob": clamp_logprob(logprob.logprob), "bytes": list(token.encode("utf-8"))}

    async def collect(self, request: ChatCompletionRequest, request_id: str, prompt: EnginePrompt,
                      stream: RequestStream, headers: dict[str, str]) -> Response:
        choices = [ChoiceAccumulator() for _ in range(request.n)]
        try:
            async for output in stream:
                for completion in output.outputs:
                    choices[completion.index].add(completion)
        except (RequestFailedError, EngineDeadError) as e:
            raise server_error(str(e)) from e
        response_choices = [
            ChatCompletionChoice(
                index=index, message=AssistantMessage(content=choice.text),
                logprobs=self.logprobs(choice.token_ids, choice.logprobs, request.top_logprobs or 0)
                if request.logprobs else None,
                finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)
            for index, choice in enumerate(choices)]
        usage = usage_of([prompt], sum(len(c.token_ids) for c in choices))
        response = ChatCompletionResponse(id=request_id, model=self.model_name, choices=response_choices, usage=usage)
        return json_response(response, headers)

    async def stream(self, request: ChatCompletionRequest, request_id: str, prompt: EnginePrompt,
                     stream: RequestStream) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatCompletionStreamChoice], usage=None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                    choices=choices, usage=usage))

        for index in range(request.n):
            yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        num_completion_tokens = 0
        try:
            async for output in stream:
                for completion in output.outputs:
                    num_completion_tokens += len(completion.token_ids)
                    logprobs = None
                    if request.logprobs:
                        logprobs = self.logprobs(completion.token_ids, completion.logprobs or [],
                                                 request.top_logprobs or 0)
                    yield chunk([ChatCompletionStreamChoice(
                        index=completion.index, delta=DeltaMessage(content=completion.text), logprobs=logprobs,
                        finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)])
            if request.include_usage:
                yield chunk([], usage_of([prompt], num_completion_tokens))
        except (RequestFailedError, EngineDeadError) as e:
            yield sse(server_error(str(e)).body)
        yield SSE_DONE
