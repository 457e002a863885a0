"""`inferno serve` options beyond the engine's; kept free of server imports so the CLI starts fast."""
import argparse
import os
from dataclasses import dataclass


@dataclass(slots=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_name: str | None = None  # None: the model file's stem
    api_key: str | None = None
    max_waiting_requests: int | None = None  # None: unbounded
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    tool_call_parser: str | None = None  # None: the chat template's format
    reasoning_parser: str | None = None  # None: no reasoning_content
    responses_store_max_items: int = 1024  # responses kept for GET /v1/responses/{id} and previous_response_id
    responses_store_max_bytes: int = 128 << 20  # ... and the bytes of their JSON, conversations included


def add_server_args(parser: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients send and see (default: the model file's stem)")
    parser.add_argument("--api-key", default=os.environ.get("INFERNO_API_KEY"),
                        help="require `Authorization: Bearer <key>` on /v1 and tokenizer routes "
                             "(default: $INFERNO_API_KEY)")
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="answer 503 when this many requests are waiting (default: unbounded)")
    parser.add_argument("--uvicorn-log-level", default=d.uvicorn_log_level,
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    parser.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"], default=None,
                        help="how tool calls are read from replies (default: from the chat template)")
    parser.add_argument("--reasoning-parser", choices=["deepseek_r1", "qwen3"], default=None,
                        help="put <think>...</think> text in reasoning_content (default: off)")
    parser.add_argument("--responses-store-max-items", type=int, default=d.responses_store_max_items,
                        help="stored /v1/responses kept in memory, least recently used dropped first "
                             f"(default: {d.responses_store_max_items}; 0: none kept)")
    parser.add_argument("--responses-store-max-bytes", type=int, default=d.responses_store_max_bytes,
                        help="bytes of JSON the stored /v1/responses may take, their conversations included "
                             f"(default: {d.responses_store_max_bytes})")


def server_config(args: argparse.Namespace) -> ServerConfig:
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError(f"max_waiting_requests must be at least 1, got {args.max_waiting_requests}")
    if args.responses_store_max_items < 0 or args.responses_store_max_bytes < 0:
        raise ValueError("responses_store_max_items and responses_store_max_bytes must not be negative")
    return ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                        api_key=args.api_key or None, max_waiting_requests=args.max_waiting_requests,
                        uvicorn_log_level=args.uvicorn_log_level,
                        disable_uvicorn_access_log=args.disable_uvicorn_access_log,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                        responses_store_max_items=args.responses_store_max_items,
                        responses_store_max_bytes=args.responses_store_max_bytes)
