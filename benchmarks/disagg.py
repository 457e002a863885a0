"""Disaggregated prefill and decode against one colocated instance: steady chats streaming while long prompts
arrive.

Starts the servers itself (SmolLM2-135M by default): one colocated `inferno serve` with --colocated-threads
threads, then one prefill and one decode instance with --threads-per-instance threads each behind `inferno proxy`.
On each setup, --chats clients stream completions back to back (short prompts, --chat-output-len tokens) for
--duration seconds while a --long-input-len token prompt arrives every --long-interval seconds (--long-output-len
tokens). Reported per setup: the chats' median and P99 inter-token latency (ITL: time between two text chunks)
and time to first token, the long prompts' TTFT, output-token throughput over the run, and (disaggregated) the
mean KV transfer time per request from the decode instance's `inferno:kv_transfer_seconds`.
"""
import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from results_md import write_section  # benchmarks/results_md.py (scripts run from this folder)

CLI = [sys.executable, "-m", "inferno.entrypoints.cli"]
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Timings:
    chat_ttft: list[float] = field(default_factory=list)
    chat_itl: list[float] = field(default_factory=list)
    long_ttft: list[float] = field(default_factory=list)
    output_tokens: int = 0
    errors: list[str] = field(default_factory=list)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: inferno's default model)")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--chat-output-len", type=int, default=64)
    p.add_argument("--long-input-len", type=int, default=2048)
    p.add_argument("--long-output-len", type=int, default=16)
    p.add_argument("--long-interval", type=float, default=6.0)
    p.add_argument("--colocated-threads", type=int, default=2)
    p.add_argument("--threads-per-instance", type=int, default=1)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    p.add_argument("--results-md", default=None, help="write the `disagg` section of this RESULTS.md")
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what a server logs once its background compile of the decode step is over (either way)
COMPILE_DONE = ("decode steps run compiled", "decode steps stay eager")


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    """A server (or proxy) healthy and, for a server, done compiling its decode step in the background: measuring
    while a compile thread holds a core would measure the compile."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    process = subprocess.Popen([*CLI, *args, "--host", "127.0.0.1", "--port", str(port)], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=log)
    process.log = log  # kept open as long as the process
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    healthy = False
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{shlex.join(args)} exited with {process.returncode}")
        try:
            healthy = healthy or httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            pass
        compiled = args[0] != "serve" or any(line in open(log.name).read() for line in COMPILE_DONE)
        if healthy and compiled:
            return process, url
        time.sleep(0.5)
    raise RuntimeError(f"{shlex.join(args)} not healthy and compiled after 600 s")


def serve_args(args: argparse.Namespace, threads: int, *extra: str) -> list[str]:
    model = ["--model", args.model] if args.model else []
    return ["serve", *model, "--num-threads", str(threads), "--kv-cache-memory", str(args.kv_cache_memory),
            "--max-model-len", str(args.long_input_len + args.long_output_len + 64), *extra]


async def stream(client: httpx.AsyncClient, url: str, prompt: str | list[int], max_tokens: int,
                 timings: Timings, is_chat: bool) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    first = True
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if chunk.get("usage"):
                    timings.output_tokens += chunk["usage"]["completion_tokens"]
                if not any(choice.get("text") for choice in chunk.get("choices", [])):
                    continue
                now = time.perf_counter()
                if first:
                    (timings.chat_ttft if is_chat else timings.long_ttft).append(now - start)
                    first = False
                elif is_chat:
                    timings.chat_itl.append(now - last)
                last = now
    except httpx.HTTPError as e:
        timings.errors.append(f"{type(e).__name__}: {e}")


async def scenario(url: str, args: argparse.Namespace) -> tuple[Timings, float]:
    timings = Timings()
    rng = random.Random(0)
    stop_at = time.perf_counter() + args.duration

    async def chat(i: int) -> None:
        turn = 0
        while time.perf_counter() < stop_at:
            await stream(client, url, f"Chat {i}, turn {turn}: tell me about the weather and the sea.",
                         args.chat_output_len, timings, is_chat=True)
            turn += 1

    long_requests = []

    async def long_prompts() -> None:
        while time.perf_counter() + args.long_interval < stop_at:
            await asyncio.sleep(args.long_interval)
            prompt = [rng.randrange(1000, 40000) for _ in range(args.long_input_len)]
            long_requests.append(asyncio.ensure_future(
                stream(client, url, prompt, args.long_output_len, timings, is_chat=False)))

    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as client:
        await stream(client, url, "warm-up", 4, Timings(), is_chat=True)
        start = time.perf_counter()
        await asyncio.gather(*(chat(i) for i in range(args.chats)), long_prompts())
        await asyncio.gather(*long_requests)
        return timings, time.perf_counter() - start


def transfer_seconds(decode_url: str) -> tuple[float, float]:
    """(sum, count) of the decode instance's kv_transfer_seconds histogram."""
    values = {}
    for line in httpx.get(f"{decode_url}/metrics").text.splitlines():
        if line.startswith(("inferno:kv_transfer_seconds_sum", "inferno:kv_transfer_seconds_count")):
            values[line.split("{")[0].rsplit("_", 1)[1]] = float(line.rsplit(" ", 1)[1])
    return values.get("sum", 0.0), values.get("count", 0.0)


def ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def run_setup(args: argparse.Namespace, disaggregated: bool) -> dict:
    processes = []
    try:
        if disaggregated:
            prefill, prefill_url = start(serve_args(args, args.threads_per_instance, "--kv-role", "prefill",
                                                    "--kv-port", str(free_port())))
            decode, decode_url = start(serve_args(args, args.threads_per_instance, "--kv-role", "decode"))
            processes += [prefill, decode]
            proxy, url = start(["proxy", "--prefill", prefill_url, "--decode", decode_url])
            processes.append(proxy)
        else:
            server, url = start(serve_args(args, args.colocated_threads))
            processes.append(server)
        before = transfer_seconds(decode_url) if disaggregated else (0.0, 0.0)
        timings, wall = asyncio.run(scenario(url, args))
        after = transfer_seconds(decode_url) if disaggregated else (0.0, 0.0)
    finally:
        for process in processes:
            process.terminate()
            process.wait()
    num_transfers = after[1] - before[1]
    return {"chat_itl_median": ms(timings.chat_itl, 50), "chat_itl_p99": ms(timings.chat_itl, 99),
            "chat_ttft_median": ms(timings.chat_ttft, 50), "chat_ttft_p99": ms(timings.chat_ttft, 99),
            "long_ttft_median": ms(timings.long_ttft, 50), "num_long": len(timings.long_ttft),
            "throughput": timings.output_tokens / wall, "errors": len(timings.errors),
            "transfer_ms": (after[0] - before[0]) / num_transfers * 1e3 if num_transfers else float("nan")}


def table(colocated: dict, disagg: dict, args: argparse.Namespace) -> str:
    rows = [("chats: median ITL (ms)", "chat_itl_median"), ("chats: P99 ITL (ms)", "chat_itl_p99"),
            ("chats: median TTFT (ms)", "chat_ttft_median"), ("chats: P99 TTFT (ms)", "chat_ttft_p99"),
            (f"{args.long_input_len}-token prompts: median TTFT (ms)", "long_ttft_median"),
            ("long prompts answered", "num_long"), ("output throughput (tok/s)", "throughput"),
            ("KV transfer per request (ms)", "transfer_ms"), ("failed requests", "errors")]
    lines = [f"| | colocated, {args.colocated_threads} threads | prefill + decode, "
             f"{args.threads_per_instance} thread each | ratio |", "|---|---|---|---|"]
    for label, key in rows:
        a, b = colocated[key], disagg[key]
        ratio = ""
        if key.startswith("chat_itl") and b:
            ratio = f"{a / b:.2f}x lower"
        elif key == "throughput" and a:
            ratio = f"{b / a:.2f}"
        lines.append(f"| {label} | {a:.1f} | {b:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    load = os.getloadavg()[0]
    colocated = run_setup(args, disaggregated=False)
    disagg = run_setup(args, disaggregated=True)
    result = table(colocated, disagg, args)
    print(result)
    if args.results_md:
        command = "cd benchmarks && python disagg.py " + shlex.join(sys.argv[1:])
        body = (f"## Disaggregated prefill and decode (`benchmarks/disagg.py`)\n\n{args.chats} chats streaming "
                f"{args.chat_output_len}-token answers back to back for {args.duration:.0f} s while a "
                f"{args.long_input_len}-token prompt arrives every {args.long_interval:.0f} s; ITL ratio = "
                f"colocated / disaggregated, throughput ratio = disaggregated / colocated. {platform.machine()}, "
                f"{os.cpu_count()} CPUs (1-minute load average {load:.1f} before the run).\n\n"
                f"```\n{command}\n```\n\n{result}")
        write_section(Path(args.results_md), "disagg", body)


if __name__ == "__main__":
    main()
