"""The FastAPI app: OpenAI routes, Anthropic's Messages routes, tokenizer routes, health and Prometheus metrics;
`run_server` starts it."""
import asyncio
import secrets
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, disable_created_metrics, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from inferno.config import EngineConfig
from inferno.core.startup_gc import gc_paused
from inferno.engine.async_llm import AsyncLLM
from inferno.engine.llm_engine import LLMEngine
from inferno.server.cli_args import ServerConfig
from inferno.server.http_metrics import HTTPMetricsMiddleware
from inferno.server.metrics import PrometheusStatLogger
from inferno.server.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, DetokenizeRequest,
    DetokenizeResponse, ErrorResponse, LoadLoRAAdapterRequest, ModelList, TokenizeChatRequest, TokenizeRequest,
    TokenizeResponse, UnloadLoRAAdapterRequest)
from inferno.server.protocol_anthropic import (
    AnthropicErrorResponse, CountTokensRequest, CountTokensResponse, MessageResponse, MessagesRequest)
from inferno.server.protocol_embeddings import EmbeddingRequest, EmbeddingResponse
from inferno.server.protocol_responses import DeletedResponse, ResponsesRequest, ResponsesResponse
from inferno.server.response_store import ResponseStore
from inferno.server.serving import OpenAIError, OpenAIServing, server_error
from inferno.server.serving_chat import ServingChat
from inferno.server.serving_completion import ServingCompletion
from inferno.server.serving_embedding import ServingEmbedding
from inferno.server.serving_messages import ServingMessages, anthropic_error_response, is_messages_route
from inferno.server.serving_models import ServingModels, runtime_lora_updating_allowed
from inferno.server.serving_responses import ServingResponses

ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 401, 404, 500, 503)}
ANTHROPIC_ERROR_RESPONSES = {status: {"model": AnthropicErrorResponse} for status in (400, 401, 404, 500, 529)}


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <api_key>` (or Anthropic's `x-api-key: <api_key>`), on /v1 and the
    tokenizer routes (pure ASGI: streams and disconnects pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _needs_api_key(scope["path"]) and not self._authorized(scope):
            error = OpenAIError("Incorrect or missing API key. Send it as `Authorization: Bearer <key>` or "
                                "`x-api-key: <key>`.", status_code=401, code="invalid_api_key")
            await error_response(scope["path"], error)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        bearer = token.strip() if scheme.lower() == b"bearer" else b""
        keys = (bearer, headers.get(b"x-api-key", b"").strip())
        return any(secrets.compare_digest(key, self.api_key) for key in keys)


def _needs_api_key(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize", "/reset_prefix_cache")


def error_response(path: str, error: OpenAIError) -> Response:
    """OpenAI's error body, or Anthropic's on Anthropic's routes."""
    return anthropic_error_response(error) if is_messages_route(path) else error.response()


def build_app(async_llm: AsyncLLM, models: ServingModels, registry: CollectorRegistry, api_key: str | None = None,
              tool_call_parser: str | None = None, reasoning_parser: str | None = None,
              response_store: ResponseStore | None = None) -> FastAPI:
    """The app serving `async_llm` under `models`' names; the engine thread starts and stops with the app's
    lifespan."""
    completions = ServingCompletion(async_llm, models)
    chat = ServingChat(async_llm, models, tool_call_parser, reasoning_parser)
    if response_store is None:
        defaults = ServerConfig()
        response_store = ResponseStore(defaults.responses_store_max_items, defaults.responses_store_max_bytes)
    responses = ServingResponses(chat, response_store)
    messages = ServingMessages(chat)
    tokenizer = OpenAIServing(async_llm, models)
    embeddings = ServingEmbedding(async_llm, models)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_llm.start()
        yield
        await asyncio.to_thread(async_llm.shutdown)

    app = FastAPI(title="inferno", description="OpenAI-compatible LLM server", lifespan=lifespan)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(HTTPMetricsMiddleware, registry=registry)  # outermost: 401s counted too

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> Response:
        return error_response(request.url.path, error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> Response:
        return error_response(request.url.path, validation_error_of(error))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        return error_response(request.url.path, OpenAIError(str(error.detail), status_code=error.status_code))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> Response:
        return error_response(request.url.path, server_error(f"internal error: {type(error).__name__}: {error}"))

    @app.get("/health")
    async def health() -> Response:
        if not async_llm.is_running:
            return server_error("the engine loop is not running").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """vLLM's endpoint: drop every cached prefix block (blocks in use are not touched)."""
        await async_llm.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=models.model_cards())

    if runtime_lora_updating_allowed():
        @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> str:
            return await models.load_lora_adapter(request)

        @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> str:
            return await models.unload_lora_adapter(request)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES)
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create(request, raw_request)

    @app.post("/v1/responses", response_model=ResponsesResponse, responses=ERROR_RESPONSES)
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create(request, raw_request)

    @app.get("/v1/responses/{response_id}", response_model=ResponsesResponse, responses=ERROR_RESPONSES)
    async def retrieve_response(response_id: str) -> ResponsesResponse:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=ERROR_RESPONSES)
    async def delete_response(response_id: str) -> DeletedResponse:
        return responses.delete(response_id)

    @app.post("/v1/messages", response_model=MessageResponse, responses=ANTHROPIC_ERROR_RESPONSES)
    async def create_message(request: MessagesRequest, raw_request: Request) -> Response:
        return await messages.create(request, raw_request)

    @app.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses=ANTHROPIC_ERROR_RESPONSES)
    async def count_message_tokens(request: CountTokensRequest) -> CountTokensResponse:
        return messages.count_tokens(request)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERROR_RESPONSES)
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await embeddings.create(request, raw_request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        tokenizer.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            text = tokenizer.chat_prompt(request.messages, request.add_generation_prompt, request.tools,
                                         request.chat_template_kwargs).text
        else:
            text = request.prompt
        token_ids = tokenizer.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        token_strs = [tokenizer.tokenizer.id_to_token(t) for t in token_ids] if request.return_token_strs else None
        return TokenizeResponse(count=len(token_ids), max_model_len=async_llm.max_model_len, tokens=token_ids,
                                token_strs=token_strs)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        tokenizer.check_model(request.model)
        bad = next((t for t in request.tokens if t >= tokenizer.vocab_size), None)
        if bad is not None:
            raise OpenAIError(f"token id {bad} is out of range for vocabulary size {tokenizer.vocab_size}",
                              param="tokens")
        return DetokenizeResponse(prompt=tokenizer.tokenizer.decode(request.tokens, skip_special_tokens=False))

    return app


def validation_error_of(error: RequestValidationError) -> OpenAIError:
    """A 400 naming the first offending top-level field (OpenAI's `param`), or the JSON that did not parse."""
    problems = error.errors()
    if any(p["type"] == "json_invalid" for p in problems):
        detail = next(p for p in problems if p["type"] == "json_invalid").get("ctx", {}).get("error", "")
        return OpenAIError(f"We could not parse the JSON body of your request: {detail}", code="invalid_json")
    messages = []
    for problem in problems[:3]:
        loc = ".".join(str(part) for part in problem["loc"] if part != "body")
        messages.append(f"{loc or 'body'}: {problem['msg']}")
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    loc = [part for part in problems[0]["loc"] if part != "body"] if problems else []
    return OpenAIError("; ".join(messages) + more, param=str(loc[0]) if loc else None)


def model_name_of(model_path: str) -> str:
    """The default served name: a GGUF file's stem, or a Hugging Face folder's name."""
    path = Path(model_path)
    return path.stem if path.is_file() else path.name


def run_server(engine_config: EngineConfig, config: ServerConfig) -> None:
    with gc_paused(freeze=True):  # the server owns its process: start-up's objects out of later collections
        engine = LLMEngine(engine_config)
    model_name = config.served_model_name or model_name_of(engine.model_path)
    disable_created_metrics()  # no `_created` series next to every counter and histogram
    registry = CollectorRegistry()
    async_llm = AsyncLLM(engine, config.max_waiting_requests, [PrometheusStatLogger(registry, model_name)])
    try:
        models = ServingModels(async_llm, model_name)
        models.add_static_loras(config.lora_modules)
        app = build_app(async_llm, models, registry, config.api_key, config.tool_call_parser,
                        config.reasoning_parser,
                        ResponseStore(config.responses_store_max_items, config.responses_store_max_bytes))
        uvicorn.run(app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
                    access_log=not config.disable_uvicorn_access_log, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
