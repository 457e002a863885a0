"""Prefix caching, measured through live servers: inferno with caching on and off, and llama-cpp-python's server.

Two workloads from benchmarks/serve.py, each against a freshly started server:
  shared-prefix: multi-turn chats sharing one long system prompt, sent one at a time (TTFT is then the prefill
                 time of what is not cached). Reported: TTFT of the requests that share >= 80 % of their tokens
                 with an earlier prompt, and of all requests.
  random:        prompts with no common prefix, all at once; caching on vs off shows what the bookkeeping costs.
Every configuration runs --repeats times; the table has medians over the repeats. llama-cpp-python (optional,
`pip install 'llama-cpp-python[server]'`) runs the shared-prefix workload on the same GGUF with the same threads.
"""
import argparse
import asyncio
import os
import platform
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import httpx
import numpy as np

import serve  # benchmarks/serve.py
from results_md import write_section

from inferno.loader.model_loader import default_model_path

SHARED = 0.8  # a request counts as sharing when at least this fraction of its tokens is a cached prefix


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, command: list[str], port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited: {shlex.join(command)}\n{self.log.read()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready: {shlex.join(command)}")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


def inferno_command(port: int, model: str, threads: int, caching: bool) -> list[str]:
    return [sys.executable, "-m", "inferno.entrypoints.cli", "serve", model, "--port", str(port),
            "--num-threads", str(threads), "--max-model-len", "4096", "--disable-uvicorn-access-log",
            "--uvicorn-log-level", "warning", "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]


def llama_cpp_command(port: int, model: str, threads: int) -> list[str]:
    return [sys.executable, "-m", "llama_cpp.server", "--model", model, "--port", str(port), "--n_ctx", "4096",
            "--n_threads", str(threads), "--n_threads_batch", str(threads)]


def shared_fractions(url: str, prompts: list[str]) -> list[float]:
    """For each prompt, the fraction of its tokens that form a prefix of an earlier prompt (in order sent)."""
    seen: list[list[int]] = []
    fractions = []
    for prompt in prompts:
        tokens = httpx.post(f"{url}/tokenize", json={"prompt": prompt}).json()["tokens"]
        best = 0
        for earlier in seen:
            n = next((i for i, (a, b) in enumerate(zip(tokens, earlier)) if a != b), min(len(tokens), len(earlier)))
            best = max(best, n)
        fractions.append(best / len(tokens))
        seen.append(tokens)
    return fractions


def run_workload(url: str, argv: list[str]) -> tuple[list[serve.RequestResult], float]:
    args = serve.parse_args(["--base-url", url, *argv])
    results, duration, _ = asyncio.run(serve.run(args))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    return results, duration


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-llama-cpp", action="store_true", help="skip the llama-cpp-python server")
    p.add_argument("--results-md", default=None, help="replace the prefix-caching section of this markdown file")
    args = p.parse_args()
    model = args.model or default_model_path()
    shared_argv = ["--dataset", "shared-prefix", "--max-concurrency", "1"]
    random_argv = ["--dataset", "random", "--num-prompts", "32", "--random-input-len", "128",
                   "--random-output-len", "32"]
    configs = [("inferno", "on", inferno_command, True), ("inferno", "off", inferno_command, False)]
    if not args.no_llama_cpp:
        configs.append(("llama-cpp-python", "its own", llama_cpp_command, None))
    prompts = [r.prompt for r in serve.shared_prefix_requests(serve.parse_args(shared_argv),
                                                              random.Random(0))]
    fractions: list[float] | None = None
    measured = {name + caching: ([], [], []) for name, caching, _, _ in configs}
    for _ in range(args.repeats):  # configurations interleaved, so a change in machine load hits them alike
        for name, caching, command, flag in configs:
            ttft_shared, ttft_all, throughputs = measured[name + caching]
            port = free_port()
            cmd = command(port, model, args.threads, flag) if flag is not None else command(port, model, args.threads)
            server = Server(cmd, port)
            try:
                if fractions is None:
                    fractions = shared_fractions(server.url, prompts)
                results, _ = run_workload(server.url, shared_argv)
                ttfts = [r.ttft for r in results]
                ttft_shared.append([t for t, f in zip(ttfts, fractions) if f >= SHARED])
                ttft_all.append(ttfts)
                if name == "inferno":
                    results, duration = run_workload(server.url, random_argv)
                    throughputs.append(sum(r.output_tokens for r in results) / duration)
            finally:
                server.close()
    rows = []
    for name, caching, _, _ in configs:
        ttft_shared, ttft_all, throughputs = measured[name + caching]
        rows.append({
            "server": name, "caching": caching,
            "ttft_shared_p50": median(float(np.median(t)) for t in ttft_shared) * 1e3,
            "ttft_shared_p99": median(float(np.percentile(t, 99)) for t in ttft_shared) * 1e3,
            "ttft_all_p50": median(float(np.median(t)) for t in ttft_all) * 1e3,
            "throughput": median(throughputs) if throughputs else None,
        })
        print(rows[-1], flush=True)
    table = ["| server | prefix caching | median TTFT, sharing ≥ 80 % (ms) | p99 TTFT, sharing ≥ 80 % (ms) "
             "| median TTFT, all (ms) | output tok/s, no shared prefix |", "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        throughput = f"{row['throughput']:.1f}" if row["throughput"] is not None else "–"
        table.append(f"| {row['server']} | {row['caching']} | {row['ttft_shared_p50']:.0f} | "
                     f"{row['ttft_shared_p99']:.0f} | {row['ttft_all_p50']:.0f} | {throughput} |")
    on, off = rows[0], rows[1]
    lines = [f"Median TTFT for prompts sharing ≥ 80 %: {off['ttft_shared_p50'] / on['ttft_shared_p50']:.2f}× lower "
             f"with caching on than off.",
             f"Throughput with no shared prefixes, caching on vs off: {on['throughput'] / off['throughput']:.3f}×."]
    if len(rows) > 2:
        lines.append(f"Median TTFT for prompts sharing ≥ 80 %: {rows[2]['ttft_shared_p50'] / on['ttft_shared_p50']:.2f}× "
                     f"lower with inferno (caching on) than llama-cpp-python.")
    num_shared = sum(f >= SHARED for f in fractions)
    text = "\n".join(table) + "\n\n" + "\n".join(lines) + "\n"
    print(text)
    if args.results_md:
        body = (f"## Prefix caching (`benchmarks/prefix_caching.py`)\n\nModel `{Path(model).name}`, {args.threads} "
                f"threads per server, medians of {args.repeats} runs, each on a freshly started server; "
                f"{platform.machine()}, {os.cpu_count()} CPUs (1-minute load average {os.getloadavg()[0]:.1f} at "
                f"the end). Shared-prefix workload: {len(prompts)} multi-turn chat prompts sent one at a time, "
                f"{num_shared} of them share ≥ 80 % of their tokens with an earlier prompt (median share "
                f"{median(fractions):.0%}). No-shared-prefix workload: 32 random 128-token prompts, 32 output "
                f"tokens each, all at once.\n\n```\npython benchmarks/prefix_caching.py "
                f"{shlex.join(sys.argv[1:])}\n```\n\n{text}")
        write_section(Path(args.results_md), "prefix-caching", body)


if __name__ == "__main__":
    main()
