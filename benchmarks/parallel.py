"""Tensor and pipeline parallelism on this machine: throughput, single-request latency and communication per step.

For each layout (TPxPP, e.g. 1x1 2x1 1x2) one engine is started with that many ranks (threads per rank: the cores
divided among the ranks unless --num-threads) and runs, after a warm-up:
- throughput: --num-prompts requests of --input-len random ordinary token ids and --output-len new tokens
  (`ignore_eos`), all added at once and stepped to the end; output tok/s = output tokens / wall time.
- single request: one --input-len prompt, --output-len new tokens, median of --repeats: TTFT = time of the first
  step; decode tok/s = (output - 1) / time of the remaining steps.
- communication: seconds rank 0 spends inside torch.distributed calls (the step broadcast, all-reduce, logits
  gather, send, recv), per step. It includes waiting for the slower rank, so it bounds the transfer cost from above;
  --comm-floor also times the bare calls between two idle processes (the transfer cost alone).
Results print as a table and replace the `parallel` section of --output.
"""
import argparse
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from inferno import LLM, SamplingParams
from results_md import write_section  # benchmarks/results_md.py (scripts run from this folder)

TOKEN_RANGE = (1000, 40000)  # ordinary (non-special) ids of the default model's vocabulary


@dataclass(slots=True)
class Comm:
    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    steps: int = 0

    def per_step_ms(self) -> float:
        return 1000 * sum(self.seconds.values()) / max(self.steps, 1)

    def calls_per_step(self) -> str:
        return ", ".join(f"{kind} {n / max(self.steps, 1):.0f}" for kind, n in sorted(self.calls.items()))


@dataclass(slots=True)
class Result:
    layout: str
    threads: int
    throughput_tok_s: float
    throughput_step_ms: float
    throughput_comm: Comm
    ttft_ms: float
    decode_tok_s: float
    decode_comm: Comm


def comm_snapshot(llm: LLM) -> tuple[dict, dict]:
    parallel = getattr(llm.llm_engine.executor, "parallel", None)
    if parallel is None:
        return {}, {}
    return dict(parallel.comm.seconds), dict(parallel.comm.calls)


def comm_since(llm: LLM, before: tuple[dict, dict], steps: int) -> Comm:
    seconds, calls = comm_snapshot(llm)
    return Comm({k: v - before[0].get(k, 0.0) for k, v in seconds.items()},
                {k: v - before[1].get(k, 0) for k, v in calls.items()}, steps)


def run_requests(llm: LLM, prompts: list[list[int]], output_len: int) -> list[float]:
    """Add every request, step until all finish; the wall time of each step."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt}, params)
    step_times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    return step_times


def run_single(llm: LLM, prompt: list[int], output_len: int) -> tuple[float, float, Comm]:
    """TTFT (the first step), the time of the decode steps, and their communication."""
    engine = llm.llm_engine
    engine.add_request(f"single-{time.monotonic_ns()}", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    start = time.perf_counter()
    engine.step()
    ttft = time.perf_counter() - start
    before, steps = comm_snapshot(llm), 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return ttft, time.perf_counter() - start, comm_since(llm, before, steps)


def bench_layout(args, tp: int, pp: int, threads: int | None, prompts: list[list[int]], single: list[int]) -> Result:
    threads = threads or max(1, len(os.sched_getaffinity(0)) // (tp * pp))
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, num_threads=threads,
              tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        run_requests(llm, prompts[:4], 8)  # warm-up
        before = comm_snapshot(llm)
        steps = run_requests(llm, prompts, args.output_len)
        throughput_comm = comm_since(llm, before, len(steps))
        throughput = len(prompts) * args.output_len / sum(steps)
        ttfts, decodes, decode_comms = [], [], []
        for _ in range(args.repeats):
            ttft, decode_s, comm = run_single(llm, single, args.output_len)
            ttfts.append(ttft)
            decodes.append((args.output_len - 1) / decode_s)
            decode_comms.append(comm)
        decode_comm = sorted(decode_comms, key=Comm.per_step_ms)[len(decode_comms) // 2]
        return Result(f"TP={tp} PP={pp}", threads, throughput,
                      1000 * sum(steps) / len(steps), throughput_comm, 1000 * statistics.median(ttfts),
                      statistics.median(decodes), decode_comm)
    finally:
        llm.llm_engine.shutdown()


# the transfer cost alone: bare calls between two idle ranks
def _comm_floor_rank(rank: int, port: int, sizes: list[int], hidden: int, queue) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    results = {}
    for rows in sizes:
        x = torch.randn(rows, hidden)
        for kind in ("all_reduce", "send/recv"):
            times = []
            for _ in range(50):
                dist.barrier()
                start = time.perf_counter()
                if kind == "all_reduce":
                    dist.all_reduce(x)
                elif rank == 0:
                    dist.send(x, 1)
                else:
                    dist.recv(x, 0)
                times.append(time.perf_counter() - start)
            results[(kind, rows)] = statistics.median(times)
    if rank == 1:
        queue.put(results)
    dist.destroy_process_group()


def comm_floor(sizes: list[int], hidden: int) -> dict:
    context = mp.get_context("spawn")
    queue = context.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [context.Process(target=_comm_floor_rank, args=(r, port, sizes, hidden, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=300)
    for p in procs:
        p.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layouts", nargs="+", default=["1x1", "1x1:1", "2x1", "1x2"],
                        help="TPxPP[:threads per rank] (default threads: the cores divided among the ranks)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    parser.add_argument("--num-threads", type=int, default=None, help="threads per rank")
    parser.add_argument("--comm-floor", action="store_true", help="also time bare all-reduce and send/recv")
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    prompts = rng.integers(*TOKEN_RANGE, size=(args.num_prompts, args.input_len)).tolist()
    single = rng.integers(*TOKEN_RANGE, size=args.input_len).tolist()
    results = []
    for layout in args.layouts:
        shape, _, threads = layout.partition(":")
        tp, pp = (int(n) for n in shape.split("x"))
        results.append(bench_layout(args, tp, pp, int(threads) if threads else args.num_threads, prompts, single))
        print_result(results[-1])
    floor = comm_floor([1, args.num_prompts, args.input_len], 576) if args.comm_floor else None
    write_results(args, results, floor)


def print_result(r: Result) -> None:
    print(f"{r.layout} ({r.threads} thread(s)/rank): {r.throughput_tok_s:.1f} output tok/s "
          f"({r.throughput_step_ms:.1f} ms/step, comm {r.throughput_comm.per_step_ms():.2f} ms/step); "
          f"single: TTFT {r.ttft_ms:.0f} ms, decode {r.decode_tok_s:.1f} tok/s, "
          f"comm {r.decode_comm.per_step_ms():.2f} ms/decode step [{r.decode_comm.calls_per_step()}]", flush=True)


def write_results(args, results: list[Result], floor: dict | None) -> None:
    command = "python benchmarks/parallel.py " + shlex.join(sys.argv[1:])
    lines = [
        "## Tensor and pipeline parallelism (`benchmarks/parallel.py`)",
        "",
        f"`{command}` — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} cores shared with other jobs (noisy), torch {torch.__version__}, "
        f"{args.dtype}, default model unless --model. Ranks are processes on this machine talking over gloo "
        f"(TCP loopback). Throughput: {args.num_prompts} requests of {args.input_len} prompt + {args.output_len} "
        f"output tokens; single request: {args.input_len} + {args.output_len}, median of {args.repeats}.",
        "",
        "| layout | threads/rank | output tok/s | ms/step | comm ms/step (rank 0) | TTFT ms | decode tok/s "
        "| comm ms/decode step (rank 0) | comm calls per decode step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(f"| {r.layout} | {r.threads} | {r.throughput_tok_s:.1f} | {r.throughput_step_ms:.1f} | "
                     f"{r.throughput_comm.per_step_ms():.2f} | {r.ttft_ms:.0f} | {r.decode_tok_s:.1f} | "
                     f"{r.decode_comm.per_step_ms():.2f} | {r.decode_comm.calls_per_step() or '—'} |")
    if floor:
        lines += ["", "Bare gloo calls between two idle ranks (median of 50; fp32 rows of 576 = hidden size):", "",
                  "| rows | all_reduce µs | send/recv µs |", "|---:|---:|---:|"]
        for rows in sorted({rows for _, rows in floor}):
            lines.append(f"| {rows} | {1e6 * floor[('all_reduce', rows)]:.0f} | {1e6 * floor[('send/recv', rows)]:.0f} |")
    body = "\n".join(lines)
    print(body)
    write_section(args.output, "parallel", body)


if __name__ == "__main__":
    main()
