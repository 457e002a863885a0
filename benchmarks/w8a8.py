"""W8A8 (int8 weights x per-token int8 activations, calibrated SmoothQuant factors) against float32 and bfloat16.

The factors are calibrated on the float32 model with `LLM.calibrate` (what `inferno calibrate` runs) on the
built-in calibration sample: none (0), one migration strength for every projection (--smoothing) and each
projection type's own (the default), each run with float32 activations; the last row is what
`LLM(model, quantization="w8a8")` runs by default (dtype "auto": bfloat16 activations on a CPU with native bfloat16).
Quality is measured as in benchmarks/quality.py on its texts (not the calibration sample): mean KL(float32 || config)
of the next-token distributions, top-1 agreement, perplexity. Prefill speed: one prompt of --prefill-tokens tokens as
one prefill step (logits of its last token only), the best of --repeats runs, wall time and CPU time of this process.
Results print as a table and replace the --section section of --output.
"""
import argparse
import gc
import shlex
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from inferno import LLM
from inferno.engine.llm_engine import LLMEngine
from inferno.request import Request
from inferno.sampling_params import SamplingParams
from inferno.worker.input_batch import MicroBatch, StepInput
from quality import QUALITY_TEXTS, compare, evaluate  # benchmarks/quality.py (scripts run from this folder)
from results_md import write_section
from throughput import machine_note

FLOAT32 = {"dtype": "float32", "quantization": None, "kv_cache_dtype": "float32"}
DEFAULTS = "w8a8 defaults (per projection type)"


@torch.inference_mode()
def prefill_seconds(engine: LLMEngine, token_ids: list[int], repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds of the fastest of `repeats` prefills of `token_ids` (last token's logits only)."""
    req = Request("prefill", token_ids, SamplingParams(), set(), engine.max_model_len)
    assert engine.kv_cache_manager.allocate_slots(req, len(token_ids)), "KV cache too small for the prompt"
    bs, n = engine.config.block_size, len(token_ids)
    mb = MicroBatch(list(token_ids), list(range(n)), [req.block_ids[p // bs] * bs + p % bs for p in range(n)],
                    decodes=[], prefills=[(n, 0, req.block_ids)], logit_rows=[n - 1])
    best = (float("inf"), float("inf"))
    try:
        engine.executor.run_step(StepInput([mb], []))  # warm-up
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            engine.executor.run_step(StepInput([mb], []))
            best = min(best, (time.perf_counter() - wall, time.process_time() - cpu))
    finally:
        engine.kv_cache_manager.free(req)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk of the quality texts (tokens)")
    p.add_argument("--smoothing", type=float, default=0.5, help="SmoothQuant migration strength alpha for all")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--output", default=str(Path(__file__).with_name("RESULTS.md")), help="'' to skip")
    p.add_argument("--section", default="w8a8", help="the section of --output to replace")
    args = p.parse_args()
    torch.set_num_threads(args.num_threads)
    common = dict(kv_cache_memory=64 << 20, num_threads=args.num_threads, enforce_eager=True)
    folder = Path(tempfile.mkdtemp())
    llm = LLM(args.model, **FLOAT32, **common)
    files = {alpha: llm.calibrate(str(folder / f"smoothing-{alpha}.json"), smoothing=alpha)
             for alpha in (0.0, args.smoothing, None)}
    model_path = llm.llm_engine.model_path
    del llm
    configurations = {
        "float32": FLOAT32,
        "bfloat16": {"dtype": "bfloat16", "quantization": None},
        **{f"w8a8, smoothing {'per projection type' if alpha is None else alpha}":
           {**FLOAT32, "quantization": "w8a8", "calibration": str(path)} for alpha, path in files.items()},
        # what `LLM(model, quantization="w8a8")` runs: dtype "auto" (bfloat16 activations where the CPU has
        # native bfloat16, as in the bfloat16 row) and the default KV cache
        DEFAULTS: {"quantization": "w8a8", "calibration": str(files[None])},
    }
    reference, texts, rows, dtypes = None, None, [], {}
    for name, engine_args in configurations.items():
        llm = LLM(args.model, **engine_args, **common)
        dtypes[name] = llm.llm_engine.config.dtype
        texts = texts or [llm.get_tokenizer().encode(t) for t in QUALITY_TEXTS]
        logprobs = evaluate(llm.llm_engine, texts, args.chunk)
        reference = reference or logprobs
        quality = compare(name, reference, logprobs, texts)
        prompt = (sum(texts, []) * (args.prefill_tokens // sum(map(len, texts)) + 1))[:args.prefill_tokens]
        wall, cpu = prefill_seconds(llm.llm_engine, prompt, args.repeats)
        rows.append((quality, wall, cpu))
        print(quality, f"prefill {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU", flush=True)
        del llm
        gc.collect()
    bf16_wall = next(wall for q, wall, _ in rows if q.name == "bfloat16")
    lines = ["## W8A8: int8 x per-token int8 with calibrated smoothing (`benchmarks/w8a8.py`)", "",
             f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- Machine: {machine_note(args.num_threads)}",
             f"- Command: `{shlex.join(['python', sys.argv[0], *sys.argv[1:]])}` (from `benchmarks/`)",
             f"- Model: `{Path(model_path).name}` dequantized to float32 (the reference), {args.num_threads} threads; "
             "float32 activations and KV cache in the float32 and `w8a8, smoothing` rows; the bfloat16 and "
             "`w8a8 defaults` rows run the defaults of that dtype / quantization (dtype auto: "
             f"{dtypes[DEFAULTS]} here)",
             f"- Quality: {rows[0][0].positions} next-token positions of benchmarks/quality.py's texts, chunks of "
             f"{args.chunk}; smoothing calibrated on the built-in sample (`inferno calibrate`)",
             f"- Prefill: one {args.prefill_tokens}-token prompt, the best of {args.repeats} runs",
             "", "| configuration | mean KL (nats) | top-1 agreement | perplexity | prefill ms (wall) | prefill ms (CPU) "
             "| speed-up vs bfloat16 (wall) |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {q.name} | {max(q.mean_kl, 0.0):.5f} | {q.top1_agreement:.2%} | {q.perplexity:.3f} | "
              f"{wall * 1e3:.1f} | {cpu * 1e3:.1f} | {bf16_wall / wall:.2f}x |" for q, wall, cpu in rows]
    body = "\n".join(lines) + "\n"
    print("\n" + body)
    if args.output:
        write_section(Path(args.output), args.section, body)
        print(f"updated {args.output}")


if __name__ == "__main__":
    main()
