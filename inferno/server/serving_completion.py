"""POST /v1/completions: one engine request per prompt, choices indexed prompt * n + sample."""
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from functools import partial

from fastapi import Request
from fastapi.responses import Response

from inferno.engine.async_llm import EngineDeadError, RequestFailedError, RequestStream
from inferno.outputs import PositionLogprobs
from inferno.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from inferno.server.serving import (
    SSE_DONE, ChoiceAccumulator, EnginePrompt, EngineStreamingResponse, OpenAIError, OpenAIServing,
    cancel_on_disconnect, clamp_logprob, json_response, merge_streams, request_id_of, server_error, sse, usage_of)


class ServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        lora_request = self.check_model(request.model)
        self.check_sampling(request)
        if request.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of other than n is not supported", param="best_of")
        prompts = self.prompts(request.prompt, "prompt")
        for prompt in prompts:
            self.check_length(prompt, request.max_tokens, "max_tokens")
        prompt_logprobs = request.logprobs if request.echo else None
        params = self.sampling_params(request, request.max_tokens, request.logprobs, prompt_logprobs)
        request_id = f"cmpl-{request_id_of(raw_request)}"
        streams = await self.add_requests(request_id, prompts, params, lora_request)
        headers = {"X-Request-Id": request_id}
        model_name = self.models.model_name(lora_request)
        if request.stream:
            return EngineStreamingResponse(self.stream(request, request_id, model_name, prompts, streams),
                                           on_close=partial(self.abort_unfinished, streams), headers=headers)
        try:
            return await cancel_on_disconnect(raw_request, self.collect(request, request_id, model_name, prompts,
                                                                        streams, headers))
        finally:
            self.abort_unfinished(streams)

    def prompt_text(self, prompt: EnginePrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)

    def logprobs(self, token_ids: list[int], positions: list[PositionLogprobs | None], num_top: int,
                 text_offset: int) -> CompletionLogprobs:
        """OpenAI's legacy logprobs: the chosen token's logprob and the top `num_top` of each position."""
        result = CompletionLogprobs()
        for token_id, position in zip(token_ids, positions):
            chosen = position.get(token_id) if position else None
            token = chosen.decoded_token if chosen and chosen.decoded_token is not None \
                else self.tokenizer.id_to_token(token_id)
            result.tokens.append(token)
            result.text_offset.append(text_offset)
            text_offset += len(token)
            result.token_logprobs.append(clamp_logprob(chosen.logprob) if chosen else None)
            result.top_logprobs.append(None if position is None else {
                lp.decoded_token or self.tokenizer.id_to_token(t): clamp_logprob(lp.logprob)
                for t, lp in position.items() if t == token_id or lp.rank <= num_top})
        return result

    def echo_logprobs(self, prompt: EnginePrompt, prompt_logprobs: list[PositionLogprobs | None] | None,
                      num_top: int) -> CompletionLogprobs:
        positions = list(prompt_logprobs or [])
        positions += [None] * (len(prompt.token_ids) - len(positions))
        return self.logprobs(prompt.token_ids, positions, num_top, 0)

    async def collect(self, request: CompletionRequest, request_id: str, model_name: str, prompts: list[EnginePrompt],
                      streams: list[RequestStream], headers: dict[str, str]) -> Response:
        n = request.n
        choices = [ChoiceAccumulator() for _ in range(len(prompts) * n)]
        prompt_logprobs: list[list[PositionLogprobs | None] | None] = [None] * len(prompts)
        kv_transfer_params = None  # a prefill instance's answer: where the prompt's KV waits
        try:
            async for i, output in merge_streams(streams):
                prompt_logprobs[i] = output.prompt_logprobs
                if output.kv_transfer_params is not None:
                    kv_transfer_params = asdict(output.kv_transfer_params)
                for completion in output.outputs:
                    choices[i * n + completion.index].add(completion)
        except (RequestFailedError, EngineDeadError) as e:
            raise server_error(str(e)) from e
        response_choices = []
        for index, choice in enumerate(choices):
            prompt = prompts[index // n]
            text, logprobs = choice.text, None
            if request.echo:
                text = self.prompt_text(prompt) + text
                if request.logprobs is not None:
                    logprobs = self.echo_logprobs(prompt, prompt_logprobs[index // n], request.logprobs)
            if request.logprobs is not None:
                generated = self.logprobs(choice.token_ids, choice.logprobs, request.logprobs,
                                          end_offset(logprobs))
                logprobs = generated if logprobs is None else join_logprobs(logprobs, generated)
            response_choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                     finish_reason=choice.finish_reason,
                                                     stop_reason=choice.stop_reason))
        usage = usage_of(prompts, sum(len(c.token_ids) for c in choices))
        response = CompletionResponse(id=request_id, model=model_name, choices=response_choices, usage=usage,
                                      kv_transfer_params=kv_transfer_params)
        return json_response(response, headers)

    async def stream(self, request: CompletionRequest, request_id: str, model_name: str, prompts: list[EnginePrompt],
                     streams: list[RequestStream]) -> AsyncIterator[str]:
        n = request.n
        created = int(time.time())
        text_offsets = [0] * (len(prompts) * n)
        echoed: set[int] = set()
        num_completion_tokens = 0
        try:
            async for i, output in merge_streams(streams):
                for completion in output.outputs:
                    index = i * n + completion.index
                    num_completion_tokens += len(completion.token_ids)
                    text, logprobs = completion.text, None
                    if request.echo and index not in echoed:
                        echoed.add(index)
                        text = self.prompt_text(prompts[i]) + text
                        if request.logprobs is not None:
                            logprobs = self.echo_logprobs(prompts[i], output.prompt_logprobs, request.logprobs)
                            text_offsets[index] = end_offset(logprobs)
                    if request.logprobs is not None:
                        generated = self.logprobs(completion.token_ids, completion.logprobs or [], request.logprobs,
                                                  text_offsets[index])
                        text_offsets[index] = end_offset(generated, text_offsets[index])
                        logprobs = generated if logprobs is None else join_logprobs(logprobs, generated)
                    choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                              finish_reason=completion.finish_reason,
                                              stop_reason=completion.stop_reason)
                    yield sse(CompletionResponse(id=request_id, created=created, model=model_name,
                                                 choices=[choice]))
            if request.include_usage:
                yield sse(CompletionResponse(id=request_id, created=created, model=model_name, choices=[],
                                             usage=usage_of(prompts, num_completion_tokens)))
        except (RequestFailedError, EngineDeadError) as e:
            yield sse(server_error(str(e)).body)
        yield SSE_DONE


def join_logprobs(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=first.text_offset + second.text_offset,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              tokens=first.tokens + second.tokens,
                              top_logprobs=first.top_logprobs + second.top_logprobs)


def end_offset(logprobs: CompletionLogprobs | None, default: int = 0) -> int:
    """Where the text after these tokens starts."""
    if logprobs is None or not logprobs.tokens:
        return default
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])

