"""What the newer API routes add to a generation: the same prompts through `/v1/chat/completions`, `/v1/responses`
(OpenAI Responses) and `/v1/messages` (Anthropic Messages) of one `inferno serve`, streamed and not.

Each round sends every prompt once per route, the routes interleaved (chat, responses, messages, chat, ...), one
request at a time, so that the machine's drift reaches every route alike. At temperature 0 the three routes render
the same chat and generate the same tokens (checked: their output token counts must agree). Reported: the median
end-to-end latency per route (send to last byte) and its ratio to chat completions' (goal: <= 1.05).

    python api_routes.py --rounds 5 --results-md RESULTS.md
"""
import argparse
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from results_md import write_section  # benchmarks/results_md.py (scripts run from this folder)

PROMPTS = [
    "Explain photosynthesis in two sentences.",
    "Give three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Describe a cat to someone who has never seen one.",
]
ROUTES = ("chat", "responses", "messages")


def request_of(route: str, model: str, prompt: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
    """The route's path and body asking for the same greedy answer to `prompt`."""
    if route == "chat":
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                                        **({"stream_options": {"include_usage": True}} if stream else {})}
    if route == "responses":
        return "/v1/responses", {"model": model, "input": prompt, "max_output_tokens": max_tokens,
                                 "temperature": 0, "stream": stream, "store": False}
    return "/v1/messages", {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def output_tokens(route: str, body: dict) -> int:
    usage = body["usage"]
    return usage["completion_tokens"] if route == "chat" else usage["output_tokens"]


def timed(client: httpx.Client, route: str, model: str, prompt: str, max_tokens: int,
          stream: bool) -> tuple[float, int | None]:
    """Seconds from sending to the last byte, and the output tokens (non-streamed requests only)."""
    path, body = request_of(route, model, prompt, max_tokens, stream)
    start = time.perf_counter()
    if stream:
        with client.stream("POST", path, json=body) as response:
            response.raise_for_status()
            for _ in response.iter_bytes():
                pass
        return time.perf_counter() - start, None
    response = client.post(path, json=body)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed, output_tokens(route, response.json())


def start_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "inferno.entrypoints.cli", "serve", "--port", str(port),
               "--disable-uvicorn-access-log", *(["--model", args.model] if args.model else [])]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("the server did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GGUF file or HF folder (default: inferno's default model)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warm-up-s", type=float, default=60.0,
                        help="seconds of requests before measuring (the server's background warm-up)")
    parser.add_argument("--results-md", type=Path)
    args = parser.parse_args()
    server, url = start_server(args)
    try:
        client = httpx.Client(base_url=url, timeout=600)
        model = client.get("/v1/models").json()["data"][0]["id"]
        deadline = time.monotonic() + args.warm_up_s
        while time.monotonic() < deadline:
            for route in ROUTES:
                timed(client, route, model, PROMPTS[0], args.max_tokens, False)
        rows = []
        for stream in (False, True):
            seconds: dict[str, list[float]] = {route: [] for route in ROUTES}
            for _ in range(args.rounds):
                for prompt in PROMPTS:
                    tokens = {}
                    for route in ROUTES:
                        elapsed, tokens[route] = timed(client, route, model, prompt, args.max_tokens, stream)
                        seconds[route].append(elapsed)
                    if not stream and len(set(tokens.values())) != 1:
                        raise SystemExit(f"the routes generated different answers to {prompt!r}: {tokens}")
            chat = statistics.median(seconds["chat"])
            for route in ROUTES:
                median = statistics.median(seconds[route])
                rows.append((route, "yes" if stream else "no", median * 1000, median / chat))
    finally:
        server.terminate()
        server.wait()
    table = ["| route | streamed | median end-to-end (ms) | vs chat completions |", "|---|---|---:|---:|"]
    table += [f"| {route} | {stream} | {ms:.1f} | {ratio:.3f} |" for route, stream, ms, ratio in rows]
    text = "\n".join(table)
    print(text)
    if args.results_md:
        command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
        cpu = os.popen("grep -m1 'model name' /proc/cpuinfo").read().split(":")[-1].strip() or platform.processor()
        body = (f"## API routes: Responses and Messages against chat completions\n\n`{command}` ({cpu}, "
                f"{time.strftime('%Y-%m-%d')}; {len(PROMPTS)} prompts x {args.rounds} rounds, "
                f"{args.max_tokens} tokens, greedy, one request at a time)\n\n{text}\n")
        write_section(args.results_md, "api_routes", body)


if __name__ == "__main__":
    main()
