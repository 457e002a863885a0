"""`inferno serve` options beyond the engine's; kept free of server imports so the CLI starts fast."""
import argparse
import json
import os
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """An adapter served from the start (vLLM's name): `name` is the model name requests send."""
    name: str
    path: str
    base_model_name: str | None = None


def lora_module(value: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form `{"name": .., "path": .., "base_model_name": ..}`."""
    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules {value!r} is not valid JSON: {e}") from None
        named = isinstance(spec, dict) and all(isinstance(spec.get(key), str) and spec[key] for key in ("name", "path"))
        if not named:
            raise argparse.ArgumentTypeError(f"--lora-modules {value!r}: a JSON module needs the string fields "
                                             "\"name\" and \"path\"")
        return LoRAModulePath(spec["name"], spec["path"], spec.get("base_model_name"))
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules {value!r}: expected name=path or a JSON object")
    return LoRAModulePath(name, path)


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
    lora_modules: list[LoRAModulePath] = field(default_factory=list)  # adapters served from the start


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
    parser.add_argument("--lora-modules", type=lora_module, nargs="+", default=[], metavar="NAME=PATH",
                        help="LoRA adapters served under their own model names (needs --enable-lora): name=path "
                             "(a PEFT folder or a GGUF LoRA file) or JSON {\"name\", \"path\", \"base_model_name\"}")


def server_config(args: argparse.Namespace) -> ServerConfig:
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError(f"max_waiting_requests must be at least 1, got {args.max_waiting_requests}")
    if args.responses_store_max_items < 0 or args.responses_store_max_bytes < 0:
        raise ValueError("responses_store_max_items and responses_store_max_bytes must not be negative")
    names = [module.name for module in args.lora_modules]
    if len(set(names)) < len(names):
        raise ValueError(f"--lora-modules names must be unique, got {', '.join(names)}")
    return ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                        api_key=args.api_key or None, max_waiting_requests=args.max_waiting_requests,
                        uvicorn_log_level=args.uvicorn_log_level,
                        disable_uvicorn_access_log=args.disable_uvicorn_access_log,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                        responses_store_max_items=args.responses_store_max_items,
                        responses_store_max_bytes=args.responses_store_max_bytes, lora_modules=args.lora_modules)
