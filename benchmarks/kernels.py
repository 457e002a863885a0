"""The native CPU kernels against PyTorch's, on SmolLM2-135M's shapes, with random data.

- paged decode attention (`torch.ops.inferno.paged_decode_attention`, bf16 cache, 9 query / 3 KV heads of 64,
  blocks of 16 in random order) against the PyTorch path it replaces when the kernel is missing (gather the
  blocks, batched matmuls, softmax);
- int4 projections (the VNNI kernel `int4_q8_matmul`, float32 input) against `torch._weight_int4pack_mm_for_cpu`
  (group 32, bf16 input): the ops alone, over the 4 weight matrices of all 30 layers in turn, so that weights come
  from memory as in a decode step, not from a hot cache;
- the LM head (49152 x 576, `Q8Linear`) against per-channel `torch._weight_int8pack_mm`.
Times are medians of --repeats; the table replaces the `kernels` section of --output.
"""
import argparse
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from inferno.kernels import paged_attention, quantized_gemv
from inferno.layers.attention import Attention, DecodeGroup, block_rows
from inferno.layers.quantization import Int4Linear, Q8Linear, quantize_groups_symmetric, quantize_int4, quantize_int8
from results_md import write_section  # benchmarks/results_md.py (scripts run from this folder)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused QKV, O, fused gate/up, down
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def median_time(fn, repeats: int, min_seconds: float = 0.2) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, calls = time.perf_counter(), 0
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        times.append(elapsed / calls)
    return statistics.median(times)


def attention_case(batch: int, context: int, repeats: int) -> tuple[float, float]:
    """Seconds per layer: the native kernel, the PyTorch gather path."""
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    attn = Attention(HEADS, KV_HEADS, HEAD_DIM)
    attn.k_cache = torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM).bfloat16()
    attn.v_cache = torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM).bfloat16()
    tables = (torch.randperm(num_blocks - 1)[:batch * blocks_per_seq] + 1).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context)
    q = torch.randn(batch, HEADS, HEAD_DIM).bfloat16()
    native = DecodeGroup(0, batch, tables, seq_lens)
    gathered = DecodeGroup(0, batch, tables, seq_lens)
    gathered.block_rows = block_rows(tables, KV_HEADS, num_blocks)
    gathered.mask = (torch.arange(blocks_per_seq * BLOCK).unsqueeze(0) < seq_lens.unsqueeze(1))[None, :, None, :]
    return (median_time(lambda: attn._decode(q, native), repeats),
            median_time(lambda: attn._decode(q, gathered), repeats))


def projections_case(rows: int, repeats: int) -> tuple[float, float]:
    """Seconds for the 120 projections of one decode step: the int4 kernel, torch's packed int4 kernel."""
    ours, theirs = [], []
    for _ in range(LAYERS):
        for n, k in PROJECTIONS:
            weight = quantize_int4(torch.randn(n, k) * 0.05, 32)
            ours.append(Int4Linear(weight, None))
            zeros = weight.mins + 8 * weight.scales
            theirs.append((torch._convert_weight_to_int4pack_for_cpu(weight.codes.int(), 1),
                           torch.stack([weight.scales.t(), zeros.t()], dim=-1).bfloat16().contiguous()))
    x = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
    x_float = {k: v.float() for k, v in x.items()}  # the op's input; in the compiled step the cast fuses upstream

    def run_ours():
        for layer in ours:
            torch.ops.inferno.int4_q8_matmul(x_float[layer.in_features], layer.weight, 32)

    def run_torch():
        for packed, scales_and_zeros in theirs:
            torch._weight_int4pack_mm_for_cpu(x[packed.shape[1] * 2], packed, 32, scales_and_zeros)
    return median_time(run_ours, repeats), median_time(run_torch, repeats)


def lm_head_case(rows: int, repeats: int) -> tuple[float, float]:
    """Seconds per call: the Q8_0 x Q8_0 kernel, per-channel `_weight_int8pack_mm`."""
    w = torch.randn(VOCAB, HIDDEN) * 0.05
    head = Q8Linear(quantize_groups_symmetric(w, 32), HIDDEN)
    codes, scales = quantize_int8(w)
    scales = scales.bfloat16()
    x = torch.randn(rows, HIDDEN).bfloat16()
    return (median_time(lambda: head(x), repeats),
            median_time(lambda: torch._weight_int8pack_mm(x, codes, scales), repeats))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", default=str(Path(__file__).with_name("RESULTS.md")), help="'' to skip")
    args = p.parse_args()
    if paged_attention() is None or quantized_gemv() is None:
        sys.exit("the native kernels could not be built (a C++ compiler is needed)")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch, context in [(1, 600), (1, 2000), (8, 600), (64, 300), (256, 200)]:
            ours, theirs = attention_case(batch, context, args.repeats)
            rows.append((threads, f"paged attention, {batch} × {context} tokens, one layer", ours, theirs, "gather + matmul"))
        for n in (1, 2, 4, 6, 8):
            ours, theirs = projections_case(n, args.repeats)
            rows.append((threads, f"int4 projections of 30 layers, {n} row(s)", ours, theirs, "_weight_int4pack_mm"))
        for n in (1, 2, 4, 6, 8):
            ours, theirs = lm_head_case(n, args.repeats)
            rows.append((threads, f"LM head 49152 × 576, {n} row(s)", ours, theirs, "_weight_int8pack_mm"))
        print(*rows[-15:], sep="\n", flush=True)
    lines = ["## Native kernels against PyTorch's (`benchmarks/kernels.py`)", "",
             f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- Machine: {torch.get_num_threads()} threads max, {platform.processor() or platform.machine()}, "
             f"torch {torch.__version__}; shared machine, compare within one run",
             f"- Command: `{' '.join(['python kernels.py', *sys.argv[1:]])}`",
             f"- Medians of {args.repeats} timings; SmolLM2-135M shapes, random data", "",
             "| threads | case | inferno | PyTorch | PyTorch's op | speed-up |", "|---:|---|---:|---:|---|---:|"]
    for threads, case, ours, theirs, op in rows:
        lines.append(f"| {threads} | {case} | {ours * 1e3:.3f} ms | {theirs * 1e3:.3f} ms | `{op}` | "
                     f"{theirs / ours:.2f}× |")
    table = "\n".join(lines)
    print(table)
    if args.output:
        write_section(Path(args.output), "kernels", table)
        print(f"updated {args.output}")


if __name__ == "__main__":
    main()
