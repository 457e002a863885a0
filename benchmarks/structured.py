"""Structured outputs: what a JSON schema costs offline, and the first-token latency of a new vs a cached schema.

  throughput: 64 chat requests with one JSON schema vs the same requests unconstrained (same max_tokens, sampled
              with a seed); output tokens per second of each (a constrained reply ends when its JSON is complete,
              so tokens per second is the fair comparison). Goal: at most 10 % slower.
  first token: one constrained request with a schema the engine has not seen (compiled before its prefill can
              start) vs the same schema again (cached), median over --repeats schemas.

    python benchmarks/structured.py --num-prompts 64 --max-tokens 96 --repeats 5
"""
import argparse
import json
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from statistics import median

import torch

from results_md import write_section

from inferno import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "scores", "address"],
}
TOPICS = ["a pilot", "a baker", "a student", "a doctor", "a painter", "a farmer", "a sailor", "a chemist"]


def throughput(llm: LLM, num_prompts: int, max_tokens: int, schema: dict | None) -> tuple[float, int]:
    conversations = [[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} number {i} as JSON."}]
                     for i in range(num_prompts)]
    outputs = StructuredOutputsParams(json=schema) if schema is not None else None
    params = SamplingParams(temperature=0.8, seed=0, max_tokens=max_tokens, structured_outputs=outputs)
    start = time.perf_counter()
    results = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in results)
    return num_tokens / elapsed, num_tokens


def first_token_latency(llm: LLM, schema: dict) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, structured_outputs=StructuredOutputsParams(json=schema))
    start = time.perf_counter()
    llm.chat([{"role": "user", "content": "A person as JSON."}], params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    llm = LLM(args.model)
    llm.wait_for_warm_up()  # the steady state: both runs with the compiled step
    throughput(llm, 4, 8, SCHEMA)  # warm-up: the tokenizer for the grammar library, first steps
    runs = {None: [], "schema": []}
    for _ in range(2):  # alternated, so that a slow spell of the machine does not land on one side only
        for key in runs:
            runs[key].append(throughput(llm, args.num_prompts, args.max_tokens, SCHEMA if key else None))
    # the faster of each (the prompts are cached from the first run on, for both sides alike)
    (plain, plain_tokens), (constrained, constrained_tokens) = (max(r, key=lambda run: run[0]) for r in runs.values())
    new, cached = [], []
    for i in range(args.repeats):
        schema = {**SCHEMA, "properties": {**SCHEMA["properties"], f"field{i}_{time.time_ns()}": {"type": "boolean"}}}
        new.append(first_token_latency(llm, schema))
        cached.append(first_token_latency(llm, schema))
    model = Path(llm.llm_engine.model_path).name
    rows = [
        f"| unconstrained | {plain:.1f} | {plain_tokens} | 1.00× |",
        f"| JSON schema | {constrained:.1f} | {constrained_tokens} | {constrained / plain:.2f}× |",
    ]
    body = "\n".join([
        f"## Structured outputs on {model} (`benchmarks/structured.py`)",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}; shared with other jobs, so numbers are "
        "noisy: compare rows of one run",
        f"- Command: `python {shlex.join(['benchmarks/structured.py', *sys.argv[1:]])}`",
        f"- Offline: {args.num_prompts} chat requests, max_tokens {args.max_tokens}, temperature 0.8, seed 0",
        "",
        "| requests | output tok/s | output tokens | × unconstrained |",
        "|---|---:|---:|---:|",
        *rows,
        "",
        f"First token of one constrained request (max_tokens 1), median of {args.repeats}: new schema "
        f"{median(new) * 1e3:.0f} ms (compiled first), cached schema {median(cached) * 1e3:.0f} ms.",
    ])
    print(body)
    if not args.no_write:
        write_section(Path(__file__).parent / "RESULTS.md", "structured-outputs", body)


if __name__ == "__main__":
    main()
