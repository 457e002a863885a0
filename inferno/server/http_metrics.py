"""Per-route HTTP metrics, as vLLM's server exports them (prometheus-fastapi-instrumentator's names):
`http_requests_total{handler, method, status}` and `http_request_duration_seconds{handler, method}`. The handler is
the route's path template (`/v1/responses/{response_id}`), so ids never become labels; a path no route serves is
`none`. The duration runs from the request to its last byte, streams included. Pure ASGI: bodies pass untouched."""
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0)


class HTTPMetricsMiddleware:
    def __init__(self, app: ASGIApp, registry: CollectorRegistry):
        self.app = app
        self.requests = Counter("http_requests_total", "HTTP requests by route, method and status class.",
                                ["handler", "method", "status"], registry=registry)
        self.duration = Histogram("http_request_duration_seconds", "HTTP request duration, to the last byte.",
                                  ["handler", "method"], buckets=DURATION_BUCKETS, registry=registry)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def send_and_note_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            handler, method = route_of(scope), scope["method"]
            self.requests.labels(handler, method, f"{status // 100}xx").inc()
            self.duration.labels(handler, method).observe(time.perf_counter() - start)


def route_of(scope: Scope) -> str:
    """The path template of the route that serves `scope`, or `none`."""
    for route in scope["app"].routes if "app" in scope else []:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return getattr(route, "path", "none")
    return "none"
