"""POST /v1/embeddings: one engine embedding request per input, answered together in OpenAI's shape."""
import base64

import numpy as np
import torch
from fastapi import Request
from fastapi.responses import Response

from inferno.engine.async_llm import EngineDeadError, RequestFailedError, RequestStream
from inferno.outputs import PoolingRequestOutput
from inferno.pooling_params import PoolingParams
from inferno.server.protocol_embeddings import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from inferno.server.serving import (EnginePrompt, OpenAIError, OpenAIServing, cancel_on_disconnect, json_response,
                                    merge_streams, request_id_of, server_error)


class ServingEmbedding(OpenAIServing):
    async def create(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        lora_request = self.check_model(request.model)
        prompts = self.prompts(request.input, "input")
        for prompt in prompts:
            self.check_input_length(prompt)
        params = self.pooling_params(request)
        request_id = f"embd-{request_id_of(raw_request)}"
        streams = await self.add_requests(request_id, prompts, params, lora_request)
        model_name = self.models.model_name(lora_request)
        try:
            return await cancel_on_disconnect(raw_request, self.collect(request, request_id, model_name, prompts,
                                                                        streams))
        finally:
            self.abort_unfinished(streams)

    def check_input_length(self, prompt: EnginePrompt) -> None:
        if len(prompt.token_ids) > self.max_model_len:
            raise OpenAIError(f"This model's maximum context length is {self.max_model_len} tokens, however you "
                              f"requested {len(prompt.token_ids)} tokens in the input for embedding generation. "
                              "Please reduce the length of the input.", param="input")

    def pooling_params(self, request: EmbeddingRequest) -> PoolingParams:
        try:
            params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
            self.input_processor.resolve_pooling(params)
        except ValueError as e:
            raise OpenAIError(str(e), param="dimensions") from e
        return params

    async def collect(self, request: EmbeddingRequest, request_id: str, model_name: str, prompts: list[EnginePrompt],
                      streams: list[RequestStream]) -> Response:
        outputs: list[PoolingRequestOutput | None] = [None] * len(prompts)
        try:
            async for i, output in merge_streams(streams):
                outputs[i] = output
        except (RequestFailedError, EngineDeadError) as e:
            raise server_error(str(e)) from e
        if any(output is None for output in outputs):
            raise server_error("the engine ended an embedding request without its vector")
        data = [EmbeddingData(index=i, embedding=encode(output.outputs.data, request.encoding_format))
                for i, output in enumerate(outputs)]
        num_tokens = sum(len(p.token_ids) for p in prompts)
        return json_response(EmbeddingResponse(id=request_id, model=model_name, data=data,
                                               usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)),
                             headers={"X-Request-Id": request_id})


def encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """A list of floats, or as OpenAI's base64: the vector's little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
