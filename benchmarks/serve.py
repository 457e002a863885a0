"""Online serving benchmark: streams requests to a running OpenAI-compatible server (`inferno serve`).

Requests arrive at --request-rate per second (Poisson: exponential gaps; inf = all at once), at most
--max-concurrency in flight. Every request streams, with `stream_options.include_usage` for its token counts.

Datasets: `random` (prompts of exactly --random-input-len tokens made from random words through the server's
/tokenize, and --random-output-len output tokens with ignore_eos), `builtin` (a few short questions, natural
stop, at most --builtin-output-len tokens) or `shared-prefix` (multi-turn chats: one long system prompt common
to --prefix-conversations conversations, each sent turn after turn with its growing history; text prompts, so
any OpenAI-compatible server can be measured; at most --prefix-output-len tokens per answer).

Metrics, per vLLM's `bench serve`: TTFT = time from sending a request to its first non-empty text chunk;
ITL = time between successive text chunks; TPOT = (E2EL - TTFT) / (output tokens - 1) per request with more
than one output token; E2EL = time from sending a request to its last byte. Throughputs = totals / wall time of
the whole run. Results print as a table; --save-result writes JSON, --results-md replaces the `serve` section.
"""
import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from results_md import write_section  # benchmarks/results_md.py (scripts run from this folder)

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "number group problem fact river mountain light music garden window story answer question paper "
         "market energy engine model token cache batch stream signal value table letter voice city").split()
BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "Give three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Name five fruits that are red.",
    "How does a refrigerator keep food cold?",
    "Translate 'good morning' into Spanish and German.",
    "What are prime numbers? Give examples.",
    "Describe a cat to someone who has never seen one.",
    "What causes the seasons on Earth?",
    "Write a short thank-you note to a teacher.",
    "How many legs does a spider have?",
    "Suggest a name for a bakery.",
]


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int | None  # None: known once the server reports usage
    max_tokens: int
    ignore_eos: bool


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("INFERNO_API_KEY"))
    p.add_argument("--dataset", default="random", choices=["random", "builtin", "shared-prefix"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--builtin-output-len", type=int, default=64)
    p.add_argument("--prefix-system-words", type=int, default=600, help="words in the shared system prompt")
    p.add_argument("--prefix-conversations", type=int, default=4)
    p.add_argument("--prefix-turns", type=int, default=4, help="turns per conversation (--num-prompts is ignored)")
    p.add_argument("--prefix-output-len", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default=None, help="write the results as JSON to this file")
    p.add_argument("--results-md", default=None, help="replace the serve section of this markdown file")
    p.add_argument("--server-command", default=None, help="how the server was started, recorded in --results-md")
    return p.parse_args(argv)


async def random_requests(client: httpx.AsyncClient, args: argparse.Namespace, rng: random.Random,
                          model: str) -> list[BenchRequest]:
    """Prompts of exactly --random-input-len tokens: random words, tokenized by the server and cut."""
    requests = []
    for _ in range(args.num_prompts):
        text = " ".join(rng.choice(WORDS) for _ in range(args.random_input_len * 2))
        tokens = (await post_json(client, "/tokenize", {"model": model, "prompt": text}))["tokens"]
        token_ids = tokens[:args.random_input_len]
        prompt = token_ids
        if args.endpoint == "/v1/chat/completions":  # chat takes text; its length is close, not exact
            prompt = (await post_json(client, "/detokenize", {"model": model, "tokens": token_ids}))["prompt"]
        requests.append(BenchRequest(prompt, None if isinstance(prompt, str) else len(token_ids),
                                     args.random_output_len, ignore_eos=True))
    return requests


def builtin_requests(args: argparse.Namespace) -> list[BenchRequest]:
    return [BenchRequest(BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)], None, args.builtin_output_len, ignore_eos=False)
            for i in range(args.num_prompts)]


def shared_prefix_requests(args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    """Turn k of every conversation is sent after turn k - 1 of all of them: system prompt + earlier turns (the
    user's question and a made-up answer) + the new question."""
    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    system = f"System: you are a helpful assistant. {words(args.prefix_system_words)}\n"
    histories = [system] * args.prefix_conversations
    requests = []
    for _ in range(args.prefix_turns):
        for c in range(args.prefix_conversations):
            question = f"User: {words(24)}?\nAssistant:"
            requests.append(BenchRequest(histories[c] + question, None, args.prefix_output_len, ignore_eos=False))
            histories[c] += f"{question} {words(40)}.\n"
    return requests


async def post_json(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    response = await client.post(path, json=body)
    response.raise_for_status()
    return response.json()


def request_body(request: BenchRequest, endpoint: str, model: str) -> dict:
    body = {"model": model, "max_tokens": request.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": request.ignore_eos}
    if endpoint == "/v1/chat/completions":
        return body | {"messages": [{"role": "user", "content": request.prompt}]}
    return body | {"prompt": request.prompt}


def chunk_text(chunk: dict) -> str:
    choice = chunk["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send(client: httpx.AsyncClient, endpoint: str, model: str, request: BenchRequest) -> RequestResult:
    result = RequestResult(prompt_len=request.prompt_len or 0)
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", endpoint, json=request_body(request, endpoint, model)) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                now = time.perf_counter()
                if chunk.get("choices") and chunk_text(chunk):
                    chunks += 1
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks  # a server without usage in streams: a token a chunk
        result.success = result.ttft > 0.0
        if not result.success:
            result.error = "no text came back"
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run(args: argparse.Namespace) -> tuple[list[RequestResult], float, str]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        rng = random.Random(args.seed)
        if args.dataset == "random":
            requests = await random_requests(client, args, rng, model)
        elif args.dataset == "shared-prefix":
            requests = shared_prefix_requests(args, rng)
        else:
            requests = builtin_requests(args)
        semaphore = asyncio.Semaphore(args.max_concurrency or len(requests))

        async def limited(request: BenchRequest) -> RequestResult:
            async with semaphore:
                return await send(client, args.endpoint, model, request)

        tasks = []
        start = time.perf_counter()
        for i, request in enumerate(requests):
            if i and args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
            tasks.append(asyncio.create_task(limited(request)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start, model


def milliseconds(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    return {"mean": float(np.mean(values)) * 1e3, "median": float(np.median(values)) * 1e3,
            "p99": float(np.percentile(values, 99)) * 1e3}


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": milliseconds([r.ttft for r in done]),
        "tpot_ms": milliseconds([(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]),
        "itl_ms": milliseconds([gap for r in done for gap in r.itl]),
        "e2el_ms": milliseconds([r.latency for r in done]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def report(summary: dict) -> str:
    lines = ["| metric | value |", "|---|---|"]
    for key, label in [("completed", "Successful requests"), ("failed", "Failed requests"),
                       ("duration_s", "Benchmark duration (s)"), ("total_input_tokens", "Total input tokens"),
                       ("total_output_tokens", "Total generated tokens"),
                       ("request_throughput", "Request throughput (req/s)"),
                       ("output_throughput", "Output token throughput (tok/s)"),
                       ("total_token_throughput", "Total token throughput (tok/s)")]:
        value = summary[key]
        lines.append(f"| {label} | {value:.2f} |" if isinstance(value, float) else f"| {label} | {value} |")
    for key, label in [("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL")]:
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            lines.append(f"| {name} {label} (ms) | {summary[key][stat]:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    load_before = os.getloadavg()[0]
    results, duration, model = asyncio.run(run(args))
    summary = summarize(results, duration)
    table = report(summary)
    print(table)
    if summary["errors"]:
        print("errors:", *summary["errors"], sep="\n  ", file=sys.stderr)
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(
            {"model": model, "config": config, **summary, "requests": [asdict(r) for r in results]}, indent=2))
    if args.results_md:
        command = "python benchmarks/serve.py " + shlex.join(sys.argv[1:])
        body = (f"## Online serving (`benchmarks/serve.py`)\n\nModel `{model}`, {args.dataset} dataset, "
                f"{args.num_prompts} prompts, {args.endpoint}, request rate {args.request_rate}/s, max concurrency "
                f"{args.max_concurrency or 'unbounded'}; {platform.machine()}, {os.cpu_count()} CPUs "
                f"(1-minute load average {load_before:.1f} before the run; the machine is shared).\n\n"
                f"```\n{args.server_command or '# server started separately'}\n{command}\n```\n\n{table}")
        write_section(Path(args.results_md), "serve", body)


if __name__ == "__main__":
    main()
