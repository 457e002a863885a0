"""Speculative decoding: tokens/s with and without drafts, at 1 and at --concurrency concurrent requests.

Engines (measured in turns, so that slow drifts of the machine hit every configuration alike; each turn is a process
of its own that loads one engine, waits for its warm-up and measures it: one engine in memory at a time): the target
--target (Qwen2.5-Coder-1.5B) plain, with n-gram, with the draft model --draft (Qwen2.5-Coder-0.5B) and with the
speculative heads --heads (--method medusa or eagle); the default model (SmolLM2-135M) plain and with n-gram. Target
and draft run as a user's `LLM(path)` does (--target-quantization auto: a GGUF's own blocks, on tiles) unless
--target-dtype / --target-quantization say otherwise. Speculating engines are also measured
with their speculation policy changed, to show what it saves: "no batch switch" (disable_by_batch_size None;
concurrent only, batch 1 is the same) and "policy off" (also draft_acceptance_threshold 0: always
num_speculative_tokens drafts).
Tasks, both as chat prompts, greedy, at most --max-tokens new tokens (EOS ends a request early; greedy speculation
gives the same tokens, so every engine produces the same output for a model):
  grounded: a given Python file (inferno/engine/block_pool.py) to return with an edit;
  chat: open questions with no text to copy.
Batch 1: decode tok/s = (output tokens - 1) / (last token time - first token time) of one request. Concurrent:
--concurrency requests (the task's prompts cycled) in one `LLM.generate` call; tok/s = output tokens / wall time
(prefill included). The prefix cache is emptied before every measurement. Each is repeated --repeats times, the
engines taking turns; the table shows medians. Acceptance: accepted / proposed draft tokens over all runs, and per
draft position. Results print as a table and replace the `spec_decode` section of --output.
"""
import argparse
import dataclasses
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
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
class Measurements:
    """One engine on one task, over all repeats."""
    model: str
    method: str
    task: str
    policy: dict = field(default_factory=dict)  # SpeculationPolicy attributes set for this configuration
    single_tok_s: list[float] = field(default_factory=list)
    concurrent_tok_s: list[float] = field(default_factory=list)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    disabled_steps: int = 0
    paused_proposals: int = 0

    @property
    def acceptance(self) -> str:
        return f"{self.accepted_tokens / self.draft_tokens:.2f}" if self.draft_tokens else "–"

    @property
    def per_pos(self) -> str:
        if not self.draft_per_pos:
            return "–"
        return " / ".join(f"{a / n:.2f}" if n else "–" for a, n in zip(self.accepted_per_pos, self.draft_per_pos))


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


def measure(llm: LLM, m: Measurements, args) -> None:
    """One batch-1 run and one concurrent run of `m`'s task, added to `m` (with the drafts they proposed)."""
    engine = llm.llm_engine
    for name, value in m.policy.items():
        setattr(engine.scheduler.spec_policy, name, value)
    stats = engine.spec_decoding_stats
    before = None if stats is None else (
        stats.num_draft_tokens, stats.num_accepted_tokens, list(stats.num_draft_tokens_per_pos),
        list(stats.num_accepted_tokens_per_pos), stats.num_disabled_steps, stats.num_paused_proposals)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    messages = task_messages(m.task)
    if m.policy != NO_BATCH_SWITCH:  # without the batch switch alone, batch 1 speculates as the engine's default
        engine.reset_prefix_cache()
        m.single_tok_s.append(decode_tok_s(llm.chat(messages[0], params, use_tqdm=False)[0]))
    engine.reset_prefix_cache()
    batch = [messages[i % len(messages)] for i in range(args.concurrency)]
    start = time.perf_counter()
    outputs = llm.chat(batch, params, use_tqdm=False)
    m.concurrent_tok_s.append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start))
    if stats is None:
        return
    m.draft_tokens += stats.num_draft_tokens - before[0]
    m.accepted_tokens += stats.num_accepted_tokens - before[1]
    m.draft_per_pos = [s + n - n0 for s, n, n0 in zip(m.draft_per_pos or [0] * len(before[2]),
                                                       stats.num_draft_tokens_per_pos, before[2])]
    m.accepted_per_pos = [s + a - a0 for s, a, a0 in zip(m.accepted_per_pos or [0] * len(before[3]),
                                                          stats.num_accepted_tokens_per_pos, before[3])]
    m.disabled_steps += stats.num_disabled_steps - before[4]
    m.paused_proposals += stats.num_paused_proposals - before[5]


NO_BATCH_SWITCH = {"disable_by_batch_size": None}
POLICY_OFF = {"disable_by_batch_size": None, "threshold": 0.0}


def engines(args):
    """(model name, engine config, [(method, policy variant)]): the target's, then the default model's. A variant
    changes the loaded engine's SpeculationPolicy for its measurements (no second engine to load)."""
    policy = {} if args.draft_acceptance_threshold is None else {
        "draft_acceptance_threshold": args.draft_acceptance_threshold}
    if args.disable_by_batch_size:
        policy["disable_by_batch_size"] = args.disable_by_batch_size
    ngram = {"method": "ngram", "num_speculative_tokens": args.num_spec_tokens, "prompt_lookup_max": 4,
             "prompt_lookup_min": 2, **policy}
    if args.target:
        big = dict(model=args.target, dtype=args.target_dtype, quantization=args.target_quantization,
                   kv_cache_memory=1 << 30, num_threads=args.num_threads)
        name = Path(args.target).stem
        yield name, dict(big), [("none", {})]
        yield name, dict(big, speculative_config=ngram), [("ngram", {}), ("ngram, no batch switch", NO_BATCH_SWITCH)]
        if args.draft:
            draft = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.num_draft_tokens,
                     **policy}
            method = f"draft {Path(args.draft).stem}"
            yield name, dict(big, speculative_config=draft), [(method, {}),
                                                              (f"{method}, no batch switch", NO_BATCH_SWITCH)]
        if args.heads:
            heads = {"method": args.method, "model": args.heads, "num_speculative_tokens": args.num_head_tokens,
                     **policy}
            method = f"{args.method} {Path(args.heads).name}"
            yield name, dict(big, speculative_config=heads), [(method, {}),
                                                              (f"{method}, no batch switch", NO_BATCH_SWITCH)]
            if args.token_tree:  # trees while few requests run (spec_decode/policy.py), chains in a busy batch
                tree = heads | {"speculative_token_tree": args.token_tree}
                if args.token_tree == "dynamic":  # EAGLE-2's tree
                    tree |= {"eagle_topk": args.eagle_topk, "num_draft_tokens": args.num_tree_tokens}
                yield name, dict(big, speculative_config=tree), [(f"{method} tree", {})]
    if not args.skip_default_model:
        small = dict(dtype=args.dtype, kv_cache_memory=1 << 30, num_threads=args.num_threads)
        yield "SmolLM2-135M", dict(small), [("none", {})]
        yield "SmolLM2-135M", dict(small, speculative_config=ngram), [
            ("ngram", {}), ("ngram, no batch switch", NO_BATCH_SWITCH), ("ngram, policy off", POLICY_OFF)]


def table(rows: list[Measurements], concurrency: int) -> str:
    base = {(r.model, r.task): r for r in rows if r.method == "none"}
    lines = ["| model | speculation | task | batch 1 tok/s | speed-up | "
             f"{concurrency} concurrent tok/s | vs none | acceptance | per position | switched off |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        b = base[(r.model, r.task)]
        concurrent = statistics.median(r.concurrent_tok_s)
        single = f"{statistics.median(r.single_tok_s):.1f} | " \
                 f"{statistics.median(r.single_tok_s) / statistics.median(b.single_tok_s):.2f}×" \
            if r.single_tok_s else "(as above) | –"
        off = "–" if r.method == "none" else f"{r.paused_proposals} paused, {r.disabled_steps} batch"
        lines.append(f"| {r.model} | {r.method} | {r.task} | {single} | {concurrent:.1f} | "
                     f"{concurrent / statistics.median(b.concurrent_tok_s):.2f}× | {r.acceptance} | {r.per_pos} | "
                     f"{off} |")
    return "\n".join(lines)


def report(rows: list[Measurements], args, repeats_done: int) -> str:
    lines = [
        "## Speculative decoding (`benchmarks/spec_decode.py`)",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {torch.get_num_threads()} torch threads on {platform.machine()}, torch {torch.__version__}; "
        "nothing else running (the rows compare only on an otherwise idle machine)",
        f"- Command: `{shlex.join(['python', sys.argv[0], *sys.argv[1:]])}`",
        f"- Greedy, at most {args.max_tokens} new tokens, chat template; n-gram: {args.num_spec_tokens} drafts, "
        f"lookup 2–4 tokens; draft model: {args.num_draft_tokens} drafts; heads: {args.num_head_tokens} drafts; "
        f"target and draft: dtype {args.target_dtype}, quantization {args.target_quantization or 'none'} ('auto': "
        f"the GGUF's own blocks, as `LLM(path)` runs them), SmolLM2 in {args.dtype}; speculation "
        f"policy: draft_acceptance_threshold "
        f"{'default' if args.draft_acceptance_threshold is None else args.draft_acceptance_threshold}, "
        f"disable_by_batch_size {args.disable_by_batch_size or 'default'}",
        f"- batch 1 tok/s: decode speed of one request, (output − 1) / (last − first token time); concurrent: "
        f"{args.concurrency} requests in one `generate` call, output tokens / wall time (prefill included); "
        f"medians of {repeats_done} repeats, engines measured in turns (a process each, after its warm-up)",
        "- acceptance: accepted / proposed draft tokens; per position: the same for the 1st, 2nd, … draft; "
        "switched off: request-steps without drafts because of low acceptance (paused) and steps with speculation "
        "off by `disable_by_batch_size` (batch)",
        "",
        table(rows, args.concurrency),
    ]
    if args.notes:
        lines += ["", Path(args.notes).read_text().rstrip()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target GGUF (e.g. models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf)")
    parser.add_argument("--draft", default=None, help="draft GGUF for --target (e.g. the 0.5B)")
    parser.add_argument("--dtype", default="float32", help="dtype of the default model")
    parser.add_argument("--target-dtype", default="auto")
    parser.add_argument("--target-quantization", default="auto", choices=["auto", "int4", "int8", "none"],
                        help="weight quantization of target and draft ('auto': a GGUF's own blocks; 'none': "
                             "dequantized to --target-dtype)")
    parser.add_argument("--tasks", nargs="+", default=["grounded", "chat"], choices=["grounded", "chat"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-spec-tokens", type=int, default=5, help="n-gram drafts per step")
    parser.add_argument("--num-draft-tokens", type=int, default=5, help="draft-model drafts per step")
    parser.add_argument("--method", default="medusa", choices=["medusa", "eagle"], help="the kind of --heads")
    parser.add_argument("--heads", default=None, help="a folder of speculative heads for --target (written by "
                                                      "`inferno train-draft-heads`, benchmarks/draft_head_prompts.py)")
    parser.add_argument("--num-head-tokens", type=int, default=3, help="drafts per step from --heads (Medusa: at "
                                                                       "most its number of heads)")
    parser.add_argument("--token-tree", default=None, help="also --heads with this speculative_token_tree, e.g. "
                        "\"[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]\", or \"dynamic\" (EAGLE-2's tree, "
                        "--method eagle; its depth: --num-head-tokens)")
    parser.add_argument("--eagle-topk", type=int, default=4, help="dynamic tree: nodes expanded per depth, children "
                                                                  "per node")
    parser.add_argument("--num-tree-tokens", type=int, default=8, help="dynamic tree: tokens verified per step, the "
                                                                       "last one included (SGLang's num_draft_tokens)")
    parser.add_argument("--draft-acceptance-threshold", type=float, default=None, help="default: the config's")
    parser.add_argument("--disable-by-batch-size", type=int, default=None)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--skip-default-model", action="store_true")
    parser.add_argument("--notes", default=None, help="a Markdown file appended to the section")
    parser.add_argument("--output", default=str(Path(__file__).parent / "RESULTS.md"))
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)  # the engine a turn measures
    args = parser.parse_args()
    if args.target_quantization == "none":
        args.target_quantization = None
    if args.child is not None:
        return measure_engine(args, args.child)
    configurations = [(name, variants) for name, _, variants in engines(args)]
    measured = [[Measurements(name, method, task, policy) for method, policy in variants for task in args.tasks]
                for name, variants in configurations]
    rows = [m for ms in measured for m in ms]
    for repeat in range(args.repeats):
        for index, ms in enumerate(measured):
            command = [sys.executable, __file__, *sys.argv[1:], "--child", str(index)]
            out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True,
                                 env=dict(os.environ, PYTHONUNBUFFERED="1")).stdout
            for m, turn in zip(ms, json.loads(out.strip().splitlines()[-1]), strict=True):
                add_turn(m, Measurements(**turn))
                single = f"{m.single_tok_s[-1]:.1f}" if m.single_tok_s else "–"
                print(f"repeat {repeat + 1}: {m.model} {m.method} {m.task}: batch 1 {single} tok/s, "
                      f"concurrent {m.concurrent_tok_s[-1]:.1f} tok/s, acceptance {m.acceptance}", flush=True)
        # partial results survive a stop
        write_section(Path(args.output), "spec_decode", report(rows, args, repeat + 1))
    print(report(rows, args, args.repeats))


def measure_engine(args, index: int) -> None:
    """A turn (in a process of its own): engine `index` of `engines`, loaded and warmed up, measured once on each
    of its variants and tasks; the measurements print as the last line, JSON."""
    name, config, variants = list(engines(args))[index]
    start = time.perf_counter()
    llm = LLM(**config)
    llm.generate("warm up", SamplingParams(max_tokens=4), use_tqdm=False)
    llm.wait_for_warm_up()
    print(f"loaded {name} ({variants[0][0]}) and warmed up in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    policy = llm.llm_engine.scheduler.spec_policy
    defaults = {} if policy is None else {"disable_by_batch_size": policy.disable_by_batch_size,
                                          "threshold": policy.threshold}
    turns = []
    for method, variant in variants:
        for task in args.tasks:
            turns.append(Measurements(name, method, task, variant))
            measure(llm, turns[-1], args)
            for attribute, value in defaults.items():  # back to the engine's own policy
                setattr(policy, attribute, value)
    print(json.dumps([dataclasses.asdict(m) for m in turns]))


def add_turn(m: Measurements, turn: Measurements) -> None:
    """One turn's measurements of `m`'s configuration added to `m`'s."""
    m.single_tok_s += turn.single_tok_s
    m.concurrent_tok_s += turn.concurrent_tok_s
    m.draft_tokens += turn.draft_tokens
    m.accepted_tokens += turn.accepted_tokens
    m.draft_per_pos = [a + b for a, b in zip(m.draft_per_pos or [0] * len(turn.draft_per_pos), turn.draft_per_pos)]
    m.accepted_per_pos = [a + b for a, b in zip(m.accepted_per_pos or [0] * len(turn.accepted_per_pos),
                                                turn.accepted_per_pos)]
    m.disabled_steps += turn.disabled_steps
    m.paused_proposals += turn.paused_proposals


if __name__ == "__main__":
    main()
