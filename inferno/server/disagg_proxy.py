"""`inferno proxy`: one OpenAI-compatible front for disaggregated prefill and decode instances.

Each completion goes first to a prefill instance (`inferno serve --kv-role prefill`) as a one-token,
non-streamed request with `kv_transfer_params: {do_remote_decode: true}`: it computes the prompt and the first
token and answers where the prompt's KV waits. The original request then goes to a decode instance (`--kv-role
decode`) with those params; it pulls the KV, decodes, and its answer — streamed or not, usage and errors
included — is relayed to the client as is. Instances are picked round-robin among the healthy ones.

Conditional disaggregation: a prompt shorter than `local_prefill_below` tokens (counted by the decode instance's
/tokenize) goes straight to a decode instance, which computes it itself: a short prompt costs the decode instance
less than a KV transfer would, and it does not queue behind long prompts on the prefill instance (NVIDIA Dynamo
decides the same way, by prefill length). Long prompts, the ones that would stall the running decodes, go through
a prefill instance. 0 sends every prompt through a prefill instance.

Requests a prefill instance cannot serve alone (several prompts, echo, logprobs, prompt_logprobs, beam search) go
straight to a decode instance, which computes the prompt itself. So does a request whose prefill instance failed
or could not be reached; a client error there (a 4xx: bad input) is the client's answer.

Health: every instance's /health is polled; one that fails it, or a request, is skipped until it answers again.
The proxy's own /health lists them (503 while a role has no healthy instance).
"""
import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inferno.server.serving import SSE_DONE, OpenAIError, server_error

logger = logging.getLogger("inferno")

FORWARDED_HEADERS = ("authorization", "x-request-id")
HEALTH_TIMEOUT_S = 2.0
LOCAL_PREFILL_BELOW = 512  # tokens: shorter prompts are computed on the decode instance


@dataclass(slots=True)
class Instance:
    url: str
    healthy: bool = True


class InstancePool:
    """The instances of one role, handed out round-robin among the healthy ones."""

    def __init__(self, role: str, urls: list[str]):
        self.role = role
        self.instances = [Instance(url.rstrip("/")) for url in urls]
        self._next = 0

    def pick(self) -> Instance | None:
        for _ in range(len(self.instances)):
            instance = self.instances[self._next % len(self.instances)]
            self._next += 1
            if instance.healthy:
                return instance
        return None

    def mark(self, instance: Instance, healthy: bool, why: str = "") -> None:
        if instance.healthy and not healthy:
            logger.warning("%s instance %s is unhealthy (%s): no more requests go to it", self.role, instance.url,
                           why)
        elif healthy and not instance.healthy:
            logger.info("%s instance %s is healthy again", self.role, instance.url)
        instance.healthy = healthy

    async def check(self, client: httpx.AsyncClient) -> None:
        async def check_one(instance: Instance) -> None:
            try:
                status = (await client.get(f"{instance.url}/health", timeout=HEALTH_TIMEOUT_S)).status_code
                self.mark(instance, status == 200, f"/health answered {status}")
            except httpx.HTTPError as e:
                self.mark(instance, False, f"/health: {type(e).__name__}")

        await asyncio.gather(*(check_one(i) for i in self.instances))

    def report(self) -> list[dict]:
        return [{"url": i.url, "healthy": i.healthy} for i in self.instances]


def runs_on_a_prefill_instance(path: str, body: dict) -> bool:
    """Whether a prefill instance's one-token answer is all the decode instance needs."""
    if body.get("use_beam_search") or body.get("prompt_logprobs") is not None or body.get("logprobs"):
        return False
    if path.endswith("/chat/completions"):
        return True
    prompt = body.get("prompt")
    single = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int))
    return bool(single) and not body.get("echo")


def tokenize_body(path: str, body: dict) -> dict | None:
    """The /tokenize request counting the prompt's tokens as the engine will see them; None for token ids."""
    if path.endswith("/chat/completions"):
        keys = ("messages", "tools", "chat_template_kwargs", "add_generation_prompt")
        return {k: body[k] for k in keys if body.get(k) is not None}
    return None if isinstance(body["prompt"], list) else {"prompt": body["prompt"]}


def prefill_body(body: dict) -> dict:
    """The request as a prefill instance runs it: the prompt and one token, sampled as the client asked."""
    request = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens", "best_of")}
    request.update(max_tokens=1, n=1, stream=False, min_tokens=min(body.get("min_tokens") or 0, 1),
                   kv_transfer_params={"do_remote_decode": True})
    return request


class DisaggProxy:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], health_check_interval: float,
                 local_prefill_below: int = LOCAL_PREFILL_BELOW):
        self.prefills = InstancePool("prefill", prefill_urls)
        self.decodes = InstancePool("decode", decode_urls)
        self.health_check_interval = health_check_interval
        self.local_prefill_below = local_prefill_below
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    async def watch_health(self) -> None:
        while True:
            await asyncio.gather(self.prefills.check(self.client), self.decodes.check(self.client))
            await asyncio.sleep(self.health_check_interval)

    async def complete(self, path: str, raw_request: Request) -> Response:
        try:
            body = json.loads(await raw_request.body())
        except json.JSONDecodeError as e:
            raise OpenAIError(f"We could not parse the JSON body of your request: {e}", code="invalid_json") from e
        if not isinstance(body, dict):
            raise OpenAIError("the request body must be a JSON object")
        headers = {k: v for k, v in raw_request.headers.items() if k in FORWARDED_HEADERS}
        decode = self.decodes.pick()
        if decode is None:
            raise OpenAIError("no healthy decode instance", status_code=503, type="server_error")
        prefill = None
        if runs_on_a_prefill_instance(path, body) and not await self._is_short(decode, path, body, headers):
            prefill = self.prefills.pick()
        if prefill is not None:
            answer = await self._prefill(prefill, path, body, headers)
            if isinstance(answer, Response):
                return answer
            if answer is not None:
                body = {**body, "kv_transfer_params": answer}
        return await self._relay(decode, path, body, headers)

    async def _is_short(self, decode: Instance, path: str, body: dict, headers: dict[str, str]) -> bool:
        """Whether the prompt has fewer than `local_prefill_below` tokens. A prompt the decode instance cannot
        tokenize counts as long: the request goes on as it would without the check, errors included."""
        if self.local_prefill_below <= 0:
            return False
        request = tokenize_body(path, body)
        if request is None:
            return len(body["prompt"]) < self.local_prefill_below
        try:
            response = await self.client.post(f"{decode.url}/tokenize", json=request, headers=headers)
        except httpx.HTTPError:
            return False
        return response.status_code == 200 and response.json()["count"] < self.local_prefill_below

    async def _prefill(self, prefill: Instance, path: str, body: dict,
                       headers: dict[str, str]) -> dict | Response | None:
        """The prefill instance's kv_transfer_params; its answer itself for a client error; None when it failed
        (the decode instance then computes the prompt)."""
        try:
            response = await self.client.post(f"{prefill.url}{path}", json=prefill_body(body), headers=headers)
        except httpx.HTTPError as e:
            self.prefills.mark(prefill, False, f"{type(e).__name__}: {e}")
            return None
        if 400 <= response.status_code < 500:
            return Response(response.content, status_code=response.status_code, media_type="application/json")
        if response.status_code != 200:
            logger.warning("prefill instance %s answered %d; the decode instance computes the prompt",
                           prefill.url, response.status_code)
            return None
        return response.json().get("kv_transfer_params")

    async def _relay(self, decode: Instance, path: str, body: dict, headers: dict[str, str]) -> Response:
        request = self.client.build_request("POST", f"{decode.url}{path}", json=body, headers=headers)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            self.decodes.mark(decode, False, f"{type(e).__name__}: {e}")
            raise OpenAIError(f"the decode instance could not be reached: {type(e).__name__}", status_code=503,
                              type="server_error") from e
        relayed = {k: v for k, v in response.headers.items() if k in ("content-type", "x-request-id")}
        if "text/event-stream" not in response.headers.get("content-type", ""):
            try:
                content = await response.aread()
            except httpx.HTTPError as e:
                self.decodes.mark(decode, False, f"{type(e).__name__}: {e}")
                raise server_error(f"the decode instance failed mid-answer: {type(e).__name__}") from e
            finally:
                await response.aclose()
            return Response(content, status_code=response.status_code, headers=relayed)
        return StreamingResponse(self._stream(decode, response), status_code=response.status_code, headers=relayed)

    async def _stream(self, decode: Instance, response: httpx.Response) -> AsyncIterator[bytes]:
        """The decode instance's server-sent events as they come; closing them (the client left) closes it."""
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            self.decodes.mark(decode, False, f"{type(e).__name__}: {e}")
            error = server_error(f"the decode instance failed mid-stream: {type(e).__name__}")
            yield f"data: {error.body.model_dump_json()}\n\n{SSE_DONE}".encode()
        finally:
            await response.aclose()

    def health(self) -> Response:
        report = {"prefill": self.prefills.report(), "decode": self.decodes.report()}
        ok = all(any(i["healthy"] for i in instances) for instances in report.values())
        return JSONResponse(report, status_code=200 if ok else 503)


def build_proxy_app(proxy: DisaggProxy) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        watcher = asyncio.create_task(proxy.watch_health())
        yield
        watcher.cancel()
        await proxy.client.aclose()

    app = FastAPI(title="inferno proxy", description="disaggregated prefill and decode", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError) -> Response:
        return error.response()

    @app.get("/health")
    async def health() -> Response:
        return proxy.health()

    @app.get("/v1/models")
    async def models(raw_request: Request) -> Response:
        decode = proxy.decodes.pick()
        if decode is None:
            raise OpenAIError("no healthy decode instance", status_code=503, type="server_error")
        headers = {k: v for k, v in raw_request.headers.items() if k in FORWARDED_HEADERS}
        try:
            response = await proxy.client.get(f"{decode.url}/v1/models", headers=headers)
        except httpx.HTTPError as e:
            proxy.decodes.mark(decode, False, f"{type(e).__name__}: {e}")
            raise OpenAIError("the decode instance could not be reached", status_code=503, type="server_error") from e
        return Response(response.content, status_code=response.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Response:
        return await proxy.complete("/v1/completions", raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw_request: Request) -> Response:
        return await proxy.complete("/v1/chat/completions", raw_request)

    return app


def run_proxy(prefill_urls: list[str], decode_urls: list[str], host: str, port: int,
              health_check_interval: float, local_prefill_below: int = LOCAL_PREFILL_BELOW,
              log_level: str = "info") -> None:
    app = build_proxy_app(DisaggProxy(prefill_urls, decode_urls, health_check_interval, local_prefill_below))
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
