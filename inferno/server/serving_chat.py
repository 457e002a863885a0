"""POST /v1/chat/completions: messages rendered with the model's chat template, one engine request."""
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from functools import partial

from fastapi import Request
from fastapi.responses import Response

from inferno.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError, RequestStream
from inferno.outputs import Logprob, PositionLogprobs
from inferno.sampling_params import SamplingParams, StructuredOutputsParams
from inferno.server.chat_output import ChatDeltaTracker, ChatOutputParser
from inferno.server.protocol import (
    AssistantMessage, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
    ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChoiceLogprobs, DeltaMessage, TokenLogprob, TopLogprob)
from inferno.server.reasoning import REASONING_PARSERS, reasoning_parser
from inferno.server.serving import (
    SSE_DONE, ChoiceAccumulator, EnginePrompt, EngineStreamingResponse, OpenAIError, OpenAIServing,
    cancel_on_disconnect, clamp_logprob, json_response, request_id_of, server_error, sse, usage_of)
from inferno.server.serving_models import ServingModels
from inferno.server.tool_calls import check_tools, tool_constraint, tool_parser, tools_for_template
from inferno.server.tool_parsers import TOOL_PARSERS, tool_parser_for_template


class ServingChat(OpenAIServing):
    def __init__(self, async_llm: AsyncLLM, models: ServingModels, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None):
        super().__init__(async_llm, models)
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {tool_call_parser!r}")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {reasoning_parser!r}")
        # auto tool choice reads calls in the chat template's format (or the one named by --tool-call-parser)
        self.tool_call_parser = tool_call_parser or tool_parser_for_template(self.tokenizer.chat_template)
        self.reasoning_parser = reasoning_parser

    def output_parser(self, request: ChatCompletionRequest) -> ChatOutputParser:
        tools = tool_parser(request.tool_choice, self.tool_call_parser) if request.tools else None
        return ChatOutputParser(reasoning_parser(self.reasoning_parser), tools)

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        lora_request = self.check_model(request.model)
        prompt, params = self.prepare(request)
        request_id = f"chatcmpl-{request_id_of(raw_request)}"
        streams = await self.add_requests(request_id, [prompt], params, lora_request)
        headers = {"X-Request-Id": request_id}
        model_name = self.models.model_name(lora_request)
        if request.stream:
            return EngineStreamingResponse(self.stream(request, request_id, model_name, prompt, streams[0]),
                                           on_close=partial(self.abort_unfinished, streams), headers=headers)
        try:
            return await cancel_on_disconnect(raw_request, self.collect(request, request_id, model_name, prompt,
                                                                        streams[0], headers))
        finally:
            self.abort_unfinished(streams)

    def prepare(self, request: ChatCompletionRequest) -> tuple[EnginePrompt, SamplingParams]:
        """The checked prompt and sampling parameters of a chat request (OpenAIError when it is bad)."""
        prompt, constraint = self.render(request)
        max_tokens = request.max_completion_tokens or request.max_tokens
        self.check_length(prompt, max_tokens, "max_completion_tokens")
        return prompt, self.engine_params(request, max_tokens, constraint)

    def render(self, request: ChatCompletionRequest) -> tuple[EnginePrompt, StructuredOutputsParams | None]:
        """The checked request's prompt, and the constraint its tool_choice needs (its model is checked by the
        route, which runs the adapter it names)."""
        self.check_sampling(request)
        self.check_chat_options(request)
        functions = check_tools(request.tools, request.tool_choice)
        constraint = tool_constraint(functions, request.tool_choice, request.parallel_tool_calls)
        if constraint is not None and (request.response_format is not None or request.structured_outputs):
            raise OpenAIError("tool_choice 'required' or a named function cannot be combined with response_format "
                              "or structured_outputs", param="tool_choice")
        prompt = self.chat_prompt(request.messages, request.add_generation_prompt,
                                  tools_for_template(request.tools, request.tool_choice), request.chat_template_kwargs)
        return prompt, constraint

    def engine_params(self, request: ChatCompletionRequest, max_tokens: int | None,
                      constraint: StructuredOutputsParams | None) -> SamplingParams:
        """The sampling parameters of a rendered request, its tool_choice's constraint included."""
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, num_logprobs, structured_outputs=constraint)
        if request.tools and request.tool_choice in (None, "auto") and self.tool_call_parser is not None:
            # tool-call markup such as <tool_call> may be special tokens: the parser must see them
            params = replace(params, skip_special_tokens=False)
        return params

    @staticmethod
    def check_chat_options(request: ChatCompletionRequest) -> None:
        if request.top_logprobs and not request.logprobs:
            raise OpenAIError("logprobs must be true when top_logprobs is set", param="top_logprobs")

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

    async def collect(self, request: ChatCompletionRequest, request_id: str, model_name: str, prompt: EnginePrompt,
                      stream: RequestStream, headers: dict[str, str]) -> Response:
        choices = [ChoiceAccumulator() for _ in range(request.n)]
        kv_transfer_params = None  # a prefill instance's answer: where the prompt's KV waits
        try:
            async for output in stream:
                if output.kv_transfer_params is not None:
                    kv_transfer_params = asdict(output.kv_transfer_params)
                for completion in output.outputs:
                    choices[completion.index].add(completion)
        except (RequestFailedError, EngineDeadError) as e:
            raise server_error(str(e)) from e
        parser = self.output_parser(request)
        response_choices = []
        for index, choice in enumerate(choices):
            reasoning, content, tool_calls = parser.message_fields(choice.text)
            response_choices.append(ChatCompletionChoice(
                index=index, message=AssistantMessage(content=content, reasoning_content=reasoning,
                                                      tool_calls=tool_calls),
                logprobs=self.logprobs(choice.token_ids, choice.logprobs, request.top_logprobs or 0)
                if request.logprobs else None,
                finish_reason=finish_reason(choice.finish_reason, bool(tool_calls)), stop_reason=choice.stop_reason))
        usage = usage_of([prompt], sum(len(c.token_ids) for c in choices))
        response = ChatCompletionResponse(id=request_id, model=model_name, choices=response_choices, usage=usage,
                                          kv_transfer_params=kv_transfer_params)
        return json_response(response, headers)

    async def stream(self, request: ChatCompletionRequest, request_id: str, model_name: str, prompt: EnginePrompt,
                     stream: RequestStream) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatCompletionStreamChoice], usage=None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model_name,
                                                    choices=choices, usage=usage))

        for index in range(request.n):
            yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        num_completion_tokens = 0
        parser = self.output_parser(request)
        trackers = [ChatDeltaTracker(parser) for _ in range(request.n)]
        try:
            async for output in stream:
                for completion in output.outputs:
                    num_completion_tokens += len(completion.token_ids)
                    logprobs = None
                    if request.logprobs:
                        logprobs = self.logprobs(completion.token_ids, completion.logprobs or [],
                                                 request.top_logprobs or 0)
                    tracker = trackers[completion.index]
                    finished = completion.finish_reason is not None
                    delta = tracker.delta(completion.text, finished)
                    if delta is None and not finished and logprobs is None:
                        continue  # text held back (it may be markup)
                    yield chunk([ChatCompletionStreamChoice(
                        index=completion.index, delta=delta or DeltaMessage(), logprobs=logprobs,
                        finish_reason=finish_reason(completion.finish_reason, tracker.num_calls > 0)
                        if finished else None, stop_reason=completion.stop_reason)])
            if request.include_usage:
                yield chunk([], usage_of([prompt], num_completion_tokens))
        except (RequestFailedError, EngineDeadError) as e:
            yield sse(server_error(str(e)).body)
        yield SSE_DONE


def finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    """OpenAI's "tool_calls" when a reply that stopped by itself made calls."""
    return "tool_calls" if has_tool_calls and reason == "stop" else reason
