"""Speculative decoding: tokens/s with and without drafts, at 1 and at --concurrency concurrent requests.

Engines (each loaded once): the default model (SmolLM2-135M) plain and with n-gram prompt lookup; the target
--target (Qwen2.5-Coder-1.5B) plain, with n-gram, and with the draft model --draft (Qwen2.5-Coder-0.5B).
Tasks, both as chat prompts, greedy, at most --max-tokens new tokens (EOS ends a request early; greedy speculation
gives the same tokens, so every engine produces the same output for a model):
  grounded: a given Python file (inferno/engine/block_pool.py) to return with a docstring added to each method;
  chat: open questions with no text to copy.
Batch 1: decode tok/s = (output tokens - 1) / (last token time - first token time) of one request, median of
--repeats. Concurrent: --concurrency requests (the task's prompts cycled) in one `LLM.generate` call; tok/s =
output tokens / wall time of the call. Acceptance: accepted / proposed draft tokens over the engine's runs, and
per draft position. Results print as a table and replace the `spec_decode` section of --output.
"""
import argparse
import gc
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from inferno import LLM, SamplingParams
from results_md import write_section  # benchmarks/results_md.py (scripts run from this folder)

ROOT = Path(__file__).resolve().parent.parent
GROUNDED_FILE = ROOT / "inferno" / "engine" / "block_pool.py"
CHAT_QUESTIONS = ["Explain in a few sentences why the sky is blue.",
                  "Give me three tips for writing readable Python code.",
                  "What is the difference between a list and a tuple in Python?",
                  "Describe a good morning routine in a short paragraph."]


@dataclass(slots=True)
class Row:
    model: str
    method: str
    task: str
    single_tok_s: float
    concurrent_tok_s: float
    acceptance: str
    per_pos: str


def task_messages(task: str) -> list[list[dict]]:
    if task == "chat":
        return [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
    code = GROUNDED_FILE.read_text()
    asks = ["Add a one-line docstring to every method of this Python file and return the whole file.",
            "Rename the variable `blocks` to `block_ids` in this Python file and return the whole file.",
            "Add type hints to every local variable of this Python file and return the whole file.",
            "Return this Python file with every comment in upper case."]
    return [[{"role": "user", "content": f"{ask}\n\n```python\n{code}```"}] for ask in asks]


def decode_tok_s(output) -> float:
    m, n = output.metrics, len(output.outputs[0].token_ids)
    return (n - 1) / (m.last_token_time - m.first_token_time) if n > 1 else float("nan")


def run_engine(llm: LLM, task: str, args) -> tuple[float, float]:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    messages = task_messages(task)
    singles = [decode_tok_s(llm.chat(messages[0], params, use_tqdm=False)[0]) for _ in range(args.repeats)]
    batch = [messages[i % len(messages)] for i in range(args.concurrency)]
    start = time.perf_counter()
    outputs = llm.chat(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return statistics.median(singles), sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def bench(name: str, method: str, llm: LLM, args) -> list[Row]:
    llm.generate("warm up", SamplingParams(max_tokens=4), use_tqdm=False)
    rows = []
    for task in args.tasks:
        stats = llm.llm_engine.spec_decoding_stats
        before = (stats.num_draft_tokens, stats.num_accepted_tokens, list(stats.num_draft_tokens_per_pos),
                  list(stats.num_accepted_tokens_per_pos)) if stats else None
        single, concurrent = run_engine(llm, task, args)
        acceptance = per_pos = "–"
        if stats:
            drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
            acceptance = f"{accepted / drafted:.2f}" if drafted else "–"
            per_pos = " / ".join(f"{(a - a0) / (n - n0):.2f}" if n > n0 else "–" for n, n0, a, a0 in zip(
                stats.num_draft_tokens_per_pos, before[2], stats.num_accepted_tokens_per_pos, before[3]))
        row = Row(name, method, task, single, concurrent, acceptance, per_pos)
        print(row, flush=True)
        rows.append(row)
    return rows


def engines(args):
    """(model name, method, engine config) in the order they run: the target first, then the default model."""
    ngram = {"method": "ngram", "num_speculative_tokens": args.num_spec_tokens, "prompt_lookup_max": 4,
             "prompt_lookup_min": 2}
    if args.target:
        big = dict(model=args.target, dtype=args.target_dtype, kv_cache_memory=1 << 30, num_threads=args.num_threads)
        name = Path(args.target).stem
        yield name, "none", dict(big)
        yield name, "ngram", dict(big, speculative_config=ngram)
        if args.draft:
            draft = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.num_draft_tokens}
            yield name, f"draft {Path(args.draft).stem}", dict(big, speculative_config=draft)
    if not args.skip_default_model:
        small = dict(dtype=args.dtype, kv_cache_memory=1 << 30, num_threads=args.num_threads)
        yield "SmolLM2-135M", "none", dict(small)
        yield "SmolLM2-135M", "ngram", dict(small, speculative_config=ngram)


def table(rows: list[Row]) -> str:
    base = {(r.model, r.task): r for r in rows if r.method == "none"}
    lines = ["| model | speculation | task | batch 1 tok/s | speed-up | "
             f"{ARGS.concurrency} concurrent tok/s | vs none | acceptance | per position |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        b = base.get((r.model, r.task))
        lines.append(f"| {r.model} | {r.method} | {r.task} | {r.single_tok_s:.1f} | "
                     f"{r.single_tok_s / b.single_tok_s:.2f}× | {r.concurrent_tok_s:.1f} | "
                     f"{r.concurrent_tok_s / b.concurrent_tok_s:.2f}× | {r.acceptance} | {r.per_pos} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target GGUF (e.g. models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf)")
    parser.add_argument("--draft", default=None, help="draft GGUF for --target (e.g. the 0.5B)")
    parser.add_argument("--dtype", default="float32", help="dtype of the default model")
    parser.add_argument("--target-dtype", default="bfloat16")
    parser.add_argument("--tasks", nargs="+", default=["grounded", "chat"], choices=["grounded", "chat"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--num-spec-tokens", type=int, default=5, help="n-gram drafts per step")
    parser.add_argument("--num-draft-tokens", type=int, default=3, help="draft-model drafts per step")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--skip-default-model", action="store_true")
    parser.add_argument("--output", default=str(Path(__file__).parent / "RESULTS.md"))
    global ARGS
    ARGS = args = parser.parse_args()
    rows = []
    for name, method, config in engines(args):
        start = time.perf_counter()
        llm = LLM(**config)
        print(f"loaded {name} ({method}) in {time.perf_counter() - start:.1f}s", flush=True)
        rows.extend(bench(name, method, llm, args))
        del llm
        gc.collect()
        write_section(Path(args.output), "spec_decode", report(rows, args))  # partial results survive a stop
    print(report(rows, args))


def report(rows: list[Row], args) -> str:
    return "\n".join([
        "## Speculative decoding (`benchmarks/spec_decode.py`)",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {torch.get_num_threads()} torch threads on {platform.machine()}, torch {torch.__version__}; "
        "shared with other jobs while measured, so compare rows within this run only",
        f"- Command: `{shlex.join(['python', sys.argv[0], *sys.argv[1:]])}`",
        f"- Greedy, at most {args.max_tokens} new tokens, chat template; n-gram: {args.num_spec_tokens} drafts, "
        f"lookup 2–4 tokens; draft model: {args.num_draft_tokens} drafts; SmolLM2 in {args.dtype}, "
        f"target and draft in {args.target_dtype}",
        "- batch 1 tok/s: decode speed of one request, (output − 1) / (last − first token time), median of "
        f"{args.repeats}; concurrent: {args.concurrency} requests in one `generate` call, output tokens / wall time",
        "- acceptance: accepted / proposed draft tokens; per position: the same for the 1st, 2nd, … draft",
        "",
        table(rows),
    ])

if __name__ == "__main__":
    main()
