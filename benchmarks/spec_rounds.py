"""Where a speculation round's time goes: one grounded request (the first of spec_decode.py's grounded task) decoded
by --target alone and with the draft model --draft proposing each of --num-draft-tokens, timed around the engine's
parts (the target's step, the proposal, each draft pass). Prints and writes the `spec_rounds` section of --output.

  python spec_rounds.py --target ../models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
      --draft ../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --num-draft-tokens 3 5 7
"""
import argparse
import collections
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from inferno import LLM, SamplingParams
from results_md import write_section  # benchmarks/results_md.py (scripts run from this folder)
from spec_decode import decode_tok_s, task_messages


def timed(obj, name: str, times: dict, label) -> None:
    """Wrap obj.name so that each call's duration is appended to times[label(*args)]."""
    method = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = method(*args, **kwargs)
        times[label(*args, **kwargs)].append(time.perf_counter() - start)
        return result
    setattr(obj, name, wrapper)


def draft_pass_label(chunks, rows) -> str:
    longest = max(len(c.token_ids) for c in chunks)
    return "draft pass, 1 token" if longest == 1 else ("draft pass, catch-up" if longest <= 16 else "draft prefill")


def profile(args, k: int) -> tuple[float, dict]:
    spec = None if k == 0 else {"method": "draft_model", "model": args.draft, "num_speculative_tokens": k}
    llm = LLM(model=args.target, quantization="int4", num_threads=args.num_threads, enable_prefix_caching=False,
              speculative_config=spec)
    engine, times = llm.llm_engine, collections.defaultdict(list)
    timed(engine.model_runner, "execute_model", times, lambda *a: "target step")
    proposer = engine.executor.worker.proposer
    if proposer is not None:
        timed(proposer, "propose", times, lambda *a: "proposal")
        timed(proposer, "_step", times, draft_pass_label)
    messages, params = task_messages("grounded")[0], SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.chat(messages, params, use_tqdm=False)  # warm-up
    times.clear()
    output = llm.chat(messages, params, use_tqdm=False)[0]
    return decode_tok_s(output), times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--num-draft-tokens", nargs="+", type=int, default=[3, 5, 7])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--output", default=str(Path(__file__).parent / "RESULTS.md"))
    args = p.parse_args()
    lines = ["| drafts | decode tok/s | speed-up | target step | proposal | draft pass, 1 token | draft pass, catch-up |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    baseline = None
    for k in [0] + args.num_draft_tokens:
        tok_s, times = profile(args, k)
        baseline = baseline or tok_s

        def ms(label: str) -> str:
            steps = times.get(label, [])[1:]  # the first holds the prompt's prefill
            return f"{statistics.median(steps) * 1e3:.1f} ms" if steps else "–"
        row = f"| {k or 'none'} | {tok_s:.1f} | {tok_s / baseline:.2f}× | {ms('target step')} | {ms('proposal')} | " \
              f"{ms('draft pass, 1 token')} | {ms('draft pass, catch-up')} |"
        print(row, flush=True)
        lines.append(row)
    command = "python " + " ".join(Path(a).name if a.endswith(".py") else a for a in sys.argv)
    body = "\n".join([
        "## Speculation rounds with a draft model (`benchmarks/spec_rounds.py`)", "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {args.num_threads} torch threads, torch {torch.__version__}; one run per row",
        f"- Command: `{command}`",
        f"- One grounded request (spec_decode.py's first), greedy, {args.max_tokens} new tokens, target "
        f"{Path(args.target).stem} and draft {Path(args.draft).stem} with int4 weights; decode tok/s as in "
        "spec_decode.py; times are medians per step after the first (target step: verification of 1 + drafts "
        "rows; proposal: all draft passes of a step)", "", *lines])
    if args.output:
        write_section(Path(args.output), "spec_rounds", body)


if __name__ == "__main__":
    main()
