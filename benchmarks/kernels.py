"""The native CPU kernels against PyTorch's, on SmolLM2-135M's shapes, with random data.

- paged decode attention (`torch.ops.inferno.paged_decode_attention`, bf16 cache, 9 query / 3 KV heads of 64,
  blocks of 16 in random order) against the PyTorch path it replaces when the kernel is missing (gather the
  blocks, batched matmuls, softmax);
- paged prefill attention (`torch.ops.inferno.paged_prefill_attention`, a fresh prompt, float32 or bfloat16, and
  steps of many float32 prompts in one call, as embeddings run) against PyTorch's causal SDPA (one call per prompt);
- int4 projections (the VNNI kernel `int4_q8_matmul`, float32 input) against `torch._weight_int4pack_mm_for_cpu`
  (group 32, bf16 input): the ops alone, over the 4 weight matrices of all 30 layers in turn, so that weights come
  from memory as in a decode step, not from a hot cache;
- the LM head (49152 x 576, `Q8Linear`) against per-channel `torch._weight_int8pack_mm`.
Times are medians of --repeats; the table replaces the `kernels` section of --output.

--q6-k instead: the Q6_K matrices of Qwen2.5-Coder-1.5B Q4_K_M (the LM head, ffn_down) as Q8 groups of 16
(`int8_q8_matmul`) against the file's super-blocks as stored (`q6_k_matmul`): ms per matrix and the weight bytes
read per second (printed only).

--tiles instead: the Q4_K and Q6_K matrices of Qwen2.5-Coder-1.5B Q4_K_M (fused gate/up, ffn_down, the LM head) as
stored (`q4_k_matmul` / `q6_k_matmul`), as the tiles the warm-up regroups them into (`q4_k_tiles_matmul` /
`q6_k_tiles_matmul`) and dequantized to bfloat16 for the dense GEMM (the stored blocks' path from 96 / 64 rows):
GMAC/s per row count, cycling over copies of a matrix so that a step's weights come from memory. The table
replaces the `tiles` section of --output.

--int4-tiles instead: SmolLM2-135M's int4 projections (qkv, gate/up, down; groups of 32) as the packed rows
(`int4_q8_matmul`), as the tiles the warm-up regroups them into (`int4_tiles_matmul`) and dequantized for the dense
GEMM, and its Q8_0 LM head likewise (`int8_q8_matmul`, `q8_tiles_matmul`): GMAC/s per row count; the table
replaces the `int4-tiles` section of --output.
"""
import argparse
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from inferno.kernels import paged_attention, q4_k_gemv, q6_k_gemv, quantized_gemv
from inferno.cpu_features import cpu_flags
from inferno.layers.attention import Attention
from inferno.layers.attention.cpu_kernel_backend import CpuKernelAttentionBackend
from inferno.layers.attention.torch_backend import TorchAttentionBackend
from inferno.layers.quantization.groups import (GroupQuantized, Q8Groups, quantize_int4, quantize_int8,
                                                quantize_q8_symmetric)
from inferno.layers.quantization.int4 import Int4Linear, pack_int4
from inferno.layers.quantization.int8 import Int8GroupLinear
from inferno.layers.quantization.q6_k import Q6KBlocks, Q6KLinear
from inferno.layers.quantization.q8 import Q8Linear
from inferno.layers.quantization.thresholds import compute_dtype
from inferno.loader.gguf_blocks import T, q8_groups
from inferno.worker.cpu_malloc import keep_freed_memory
from results_md import write_section  # benchmarks/results_md.py (scripts run from this folder)

COMPUTE_DTYPE = compute_dtype()  # the quantized layers' dense GEMMs on this CPU
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused QKV, O, fused gate/up, down
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


CLOCK = time.perf_counter  # --cpu-time: time.thread_time, the CPU time of the (one) thread doing the work


def median_time(fn, repeats: int, min_seconds: float = 0.2) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, calls = CLOCK(), 0
        while True:
            fn()
            calls += 1
            elapsed = CLOCK() - start
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
    times = []
    for backend in (CpuKernelAttentionBackend, TorchAttentionBackend):
        backend = backend(BLOCK, KV_HEADS, num_blocks, None)
        group = backend.decode_metadata(torch.zeros(0, dtype=torch.long), tables, seq_lens).decode_groups[0]
        times.append(median_time(lambda: backend.decode(attn, q, group), repeats))
    return times[0], times[1]


def prefill_attention_case(prompts: list[int], dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """Seconds per layer for fresh prompts of these lengths packed in one step: the native flash-attention kernel
    (one call for them all), PyTorch's SDPA (causal, one call per prompt), both over the prompts' own K/V as
    computed."""
    tokens, blocks = sum(prompts), sum(-(-n // BLOCK) for n in prompts)
    attn = Attention(HEADS, KV_HEADS, HEAD_DIM)
    cache_dtype = torch.float16 if dtype == torch.float32 else dtype
    attn.k_cache = torch.randn(KV_HEADS, blocks + 1, BLOCK, HEAD_DIM).to(cache_dtype)
    attn.v_cache = torch.randn(KV_HEADS, blocks + 1, BLOCK, HEAD_DIM).to(cache_dtype)
    block_ids = (torch.randperm(blocks) + 1).tolist()
    tables = []
    for n in prompts:
        tables.append(block_ids[:-(-n // BLOCK)])
        del block_ids[:-(-n // BLOCK)]
    q = torch.randn(tokens, HEADS, HEAD_DIM).to(dtype)
    k, v = torch.randn(tokens, KV_HEADS, HEAD_DIM).to(dtype), torch.randn(tokens, KV_HEADS, HEAD_DIM).to(dtype)
    backend = CpuKernelAttentionBackend(BLOCK, KV_HEADS, blocks + 1, None)
    step = backend.build_metadata([], [], [(n, 0, table) for n, table in zip(prompts, tables)]).prefills[0]
    sdpa = TorchAttentionBackend(BLOCK, KV_HEADS, blocks + 1, None)
    chunks = [sdpa.build_metadata([], [], [(n, 0, table)]).prefills[0] for n, table in zip(prompts, tables)]
    rows = list(zip(q.split(prompts), k.split(prompts), v.split(prompts), chunks))
    return (median_time(lambda: backend.prefill(attn, q, k, v, step), repeats),
            median_time(lambda: [sdpa.prefill(attn, *row) for row in rows], repeats))


def packed_prompts(count: int, shortest: int, longest: int) -> list[int]:
    """`count` prompt lengths drawn uniformly from [shortest, longest] (seeded: the same in every run)."""
    return torch.randint(shortest, longest + 1, (count,), generator=torch.Generator().manual_seed(0)).tolist()


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
    head = Q8Linear(quantize_q8_symmetric(w, 32), HIDDEN)
    codes, scales = quantize_int8(w)
    scales = scales.bfloat16()
    x = torch.randn(rows, HIDDEN).bfloat16()
    return (median_time(lambda: head(x), repeats),
            median_time(lambda: torch._weight_int8pack_mm(x, codes, scales), repeats))


# One decode step's projections, per layer: (N, K) of fused QKV, O, fused gate/up, down; layers; the LM head.
MODELS = {"smollm2-135m": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, (49152, 576)),
          "qwen2.5-1.5b": ([(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)], 28, (151936, 1536))}
TIMED_LAYERS = 4  # weights of 4 layers (>= 100 MB int4 for the 1.5B) stream from memory; times are scaled up


def q8_matmul(x: torch.Tensor, weight: Q8Groups) -> torch.Tensor:
    """`int8_q8_matmul`, also as main's kernel had it before Q8Groups (codes c + 128, symmetric groups of 32)."""
    op = torch.ops.inferno.int8_q8_matmul
    if len(op.default._schema.arguments) == 3:
        return op(x, weight.codes.view(torch.uint8) ^ 128, weight.scales)
    return op(x, weight.codes, weight.scales, weight.mins, weight.group_size)


def random_q6_k(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random Q6_K rows [n, k / 256 * 210] with a small d (every other byte pattern is data)."""
    blocks = torch.randint(0, 256, (n, k // 256, 210), dtype=torch.uint8, generator=g)
    blocks[..., 208:210] = torch.tensor([1e-4], dtype=torch.float16).view(torch.uint8)
    return blocks.view(n, -1)


def random_weights(kind: str, n: int, k: int, g: torch.Generator):
    """Random codes of `kind` (their values do not change the kernels' time)."""
    if kind == "q6_k_blocks":
        return Q6KLinear(Q6KBlocks(random_q6_k(n, k, g)))
    if kind == "int4":
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        return Int4Linear(GroupQuantized(codes, torch.rand(n, k // 32, generator=g) / 50, -torch.rand(n, k // 32) / 5), None)
    if kind == "int8-group":
        codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
        return Int8GroupLinear(GroupQuantized(codes, torch.rand(n, k // 32) / 500, -torch.rand(n, k // 32) / 5), None)
    group_size, with_mins = {"q8_0": (32, False), "q5_k": (32, True), "q6_k": (16, False)}[kind]
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    mins = -torch.rand(n, k // group_size) / 5 if with_mins else None
    return Q8Groups(codes, torch.rand(n, k // group_size) / 500, mins)


def kernel_call(kind: str, weight, x: torch.Tensor) -> torch.Tensor:
    if kind == "q6_k_blocks":
        return torch.ops.inferno.q6_k_matmul(x, weight.weight)
    if kind == "int4":
        return torch.ops.inferno.int4_q8_matmul(x, weight.weight, 32)
    if kind == "int8-group":
        return torch.ops.inferno.int8_group_matmul(x, weight.weight, weight.scales, weight.mins, 32)
    return q8_matmul(x, weight)


def dense_call(kind: str, weight, x: torch.Tensor) -> torch.Tensor:
    """What a layer runs from its crossover on: dequantize to COMPUTE_DTYPE, then the dense GEMM."""
    if kind == "int8-group":
        return F.linear(x, weight.dequantize())
    if kind in ("int4", "q6_k_blocks"):
        return F.linear(x.to(COMPUTE_DTYPE), weight.dequantize(COMPUTE_DTYPE))
    return F.linear(x.to(COMPUTE_DTYPE), weight.dequantize().to(COMPUTE_DTYPE))


def step_projections(model: str, kind: str, rows: list[int], repeats: int, dense: bool) -> list[tuple]:
    """(rows, ms per decode step of all layers' projections with the kernel, with dequantize + dense GEMM)."""
    shapes, layers, _ = MODELS[model]
    g = torch.Generator().manual_seed(0)
    weights = [(random_weights(kind, n, k, g), k) for _ in range(TIMED_LAYERS) for n, k in shapes]
    out = []
    for m in rows:
        x = {k: torch.randn(m, k) for _, k in shapes}
        ours = median_time(lambda: [kernel_call(kind, w, x[k]) for w, k in weights], repeats)
        theirs = median_time(lambda: [dense_call(kind, w, x[k]) for w, k in weights], 3) if dense else float("nan")
        out.append((m, ours * layers / TIMED_LAYERS * 1e3, theirs * layers / TIMED_LAYERS * 1e3))
        print(model, kind, out[-1], flush=True)
    return out


def projections_table(models: list[str], kinds: list[str], rows: list[int], repeats: int, dense: bool) -> str:
    lines = ["| model | weights | rows | kernel ms/step | dequantize + GEMM ms/step |", "|---|---|---:|---:|---:|"]
    for model in models:
        for kind in kinds:
            for m, ours, theirs in step_projections(model, kind, rows, repeats, dense):
                lines.append(f"| {model} | {kind} | {m} | {ours:.2f} | {theirs:.2f} |")
    return "\n".join(lines)


# The Q6_K matrices of Qwen2.5-Coder-1.5B Q4_K_M: (name, N, K, copies); ffn_down is Q6_K in 14 of the 28 layers,
# timed over 14 copies in turn so that its weights come from memory as in a decode step.
Q6_K_MATRICES = [("LM head", 151936, 1536, 1), ("ffn_down", 1536, 8960, 14)]


def q6_k_table(rows: list[int], repeats: int) -> str:
    """ms per matrix and GB/s of weights read: Q8 groups of 16 (as main loaded Q6_K) against the blocks as stored."""
    lines = ["| matrix | rows | Q8 groups of 16 ms | GB/s | Q6_K as stored ms | GB/s | speed-up |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    g = torch.Generator().manual_seed(0)
    for name, n, k, copies in Q6_K_MATRICES:
        raws = [random_q6_k(n, k, g) for _ in range(copies)]
        q8 = [q8_groups(raw, T.Q6_K) for raw in raws]
        q8_bytes = sum(w.codes.numel() + 4 * w.scales.numel() for w in q8) / copies
        q6_bytes = raws[0].numel()
        for m in rows:
            x = torch.randn(m, k)
            ours = median_time(lambda: [torch.ops.inferno.q6_k_matmul(x, raw) for raw in raws], repeats) / copies
            theirs = median_time(lambda: [q8_matmul(x, w) for w in q8], repeats) / copies
            lines.append(f"| {name} {n} × {k} | {m} | {theirs * 1e3:.2f} | {q8_bytes / theirs / 1e9:.1f} | "
                         f"{ours * 1e3:.2f} | {q6_bytes / ours / 1e9:.1f} | {theirs / ours:.2f}× |")
            print(lines[-1], flush=True)
        del raws, q8
    return "\n".join(lines)


def random_q4_k(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random Q4_K rows [n, k / 256 * 144] with small d and dmin (every other byte pattern is data)."""
    blocks = torch.randint(0, 256, (n, k // 256, 144), dtype=torch.uint8, generator=g)
    blocks[..., 0:4] = torch.tensor([1e-3, 2e-3], dtype=torch.float16).view(torch.uint8)
    return blocks.view(n, -1)


# Qwen2.5-Coder-1.5B Q4_K_M: (type, name, N, K, copies timed in turn)
TILED_MATRICES = [("Q4_K", "gate/up", 17920, 1536, 8), ("Q4_K", "ffn_down", 1536, 8960, 16),
                  ("Q6_K", "ffn_down", 1536, 8960, 16), ("Q6_K", "LM head", 151936, 1536, 1)]


def tiles_table(rows: list[int], repeats: int) -> str:
    lines = ["| type | matrix | rows | as stored GMAC/s | tiles GMAC/s | dequantize + bf16 GEMM GMAC/s | tiles × stored |",
             "|---|---|---:|---:|---:|---:|---:|"]
    g = torch.Generator().manual_seed(0)
    for qtype, name, n, k, copies in TILED_MATRICES:
        op = qtype.lower()
        raws = [(random_q4_k if qtype == "Q4_K" else random_q6_k)(n, k, g) for _ in range(copies)]
        tiles = [getattr(torch.ops.inferno, f"{op}_tile")(raw) for raw in raws]
        stored, tiled = getattr(torch.ops.inferno, f"{op}_matmul"), getattr(torch.ops.inferno, f"{op}_tiles_matmul")
        dequantize = getattr(torch.ops.inferno, f"{op}_dequantize")
        for m in rows:
            if name == "LM head" and m > 32:  # it runs on the rows that sample: decode batches
                continue
            x, macs = torch.randn(m, k), m * n * k / 1e9
            times = [median_time(lambda: [fn(x, w) for w in ws], repeats) / copies
                     for fn, ws in ((stored, raws), (tiled, tiles))]
            xb = x.bfloat16()
            dense = median_time(lambda: F.linear(xb, dequantize(raws[0], torch.bfloat16)), repeats) if m >= 32 else None
            lines.append(f"| {qtype} | {name} {n} × {k} | {m} | {macs / times[0]:.0f} | {macs / times[1]:.0f} | "
                         f"{'–' if dense is None else f'{macs / dense:.0f}'} | {times[0] / times[1]:.2f}× |")
            print(lines[-1], flush=True)
        del raws, tiles
    return "\n".join(lines)


# SmolLM2-135M's int4 projections (Q4_1 file, groups of 32): (name, N, K, copies timed in turn)
INT4_TILED_MATRICES = [("qkv", 960, 576, 30), ("gate/up", 3072, 576, 30), ("down", 576, 1536, 30)]


def int4_tiles_table(rows: list[int], repeats: int) -> str:
    dense_name = "bf16" if COMPUTE_DTYPE == torch.bfloat16 else "float32"
    lines = [f"| matrix | rows | packed rows GMAC/s | tiles GMAC/s | dequantize + {dense_name} GEMM GMAC/s | "
             "tiles × packed |", "|---|---:|---:|---:|---:|---:|"]
    g = torch.Generator().manual_seed(0)
    ops = torch.ops.inferno
    for name, n, k, copies in INT4_TILED_MATRICES:
        packed = [pack_int4(quantize_int4(torch.randn(n, k, generator=g), 32)) for _ in range(copies)]
        tiles = [ops.int4_tile(w, k, 32) for w in packed]
        for m in rows:
            x, macs = torch.randn(m, k), m * n * k / 1e9
            stored = median_time(lambda: [ops.int4_q8_matmul(x, w, 32, False) for w in packed], repeats) / copies
            tiled = median_time(lambda: [ops.int4_tiles_matmul(x, t, False) for t in tiles], repeats) / copies
            xd = x.to(COMPUTE_DTYPE)
            dense = (median_time(lambda: F.linear(xd, ops.int4_dequantize(packed[0], k, 32, COMPUTE_DTYPE)), repeats)
                     if m >= 32 else None)
            lines.append(f"| {name} {n} × {k} | {m} | {macs / stored:.0f} | {macs / tiled:.0f} | "
                         f"{'–' if dense is None else f'{macs / dense:.0f}'} | {stored / tiled:.2f}× |")
            print(lines[-1], flush=True)
    n, k = 49152, 576  # the LM head: Q8_0 (symmetric int8 groups of 32) as codes and scales, and as Q8 tiles
    head = quantize_q8_symmetric(torch.randn(n, k, generator=g), 32)
    tiles = ops.q8_tile(head.codes, head.scales)
    for m in rows:
        x, macs = torch.randn(m, k), m * n * k / 1e9
        stored = median_time(lambda: ops.int8_q8_matmul(x, head.codes, head.scales, None, 32), repeats)
        tiled = median_time(lambda: ops.q8_tiles_matmul(x, tiles), repeats)
        xd = x.to(COMPUTE_DTYPE)
        dense = (median_time(lambda: F.linear(xd, ops.int8_q8_dequantize(head.codes, head.scales, None, 32,
                                                                          COMPUTE_DTYPE)), repeats)
                 if m >= 32 else None)
        lines.append(f"| LM head (Q8) {n} × {k} | {m} | {macs / stored:.0f} | {macs / tiled:.0f} | "
                     f"{'–' if dense is None else f'{macs / dense:.0f}'} | {stored / tiled:.2f}× |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def write_tiles_report(args: argparse.Namespace, section: str, title: str, data: str, table_of) -> None:
    """A tiles table (`table_of(rows, repeats)`) on the last --threads, with the run's date, machine and command;
    printed, and written as `section` of --output."""
    torch.set_num_threads(args.threads[-1])
    keep_freed_memory()  # as the engine does: a large temporary is not a fresh mmap each time
    flags = " ".join(sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni"}))
    table = "\n".join([
        f"## {title}", "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {platform.processor() or platform.machine()} ({flags}), {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; shared machine, compare within one run",
        f"- Command: `{' '.join(['python kernels.py', *sys.argv[1:]])}`",
        f"- Medians of {args.repeats} timings; {data}", "",
        table_of(args.rows, args.repeats)])
    print(table)
    if args.output:
        write_section(Path(args.output), section, table)
        print(f"updated {args.output}")

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", default=str(Path(__file__).with_name("RESULTS.md")), help="'' to skip")
    p.add_argument("--projections", nargs="*", choices=list(MODELS), default=None,
                   help="instead: ms per decode step of these models' projections, kernel against dense")
    p.add_argument("--q6-k", action="store_true", help="instead: Q6_K as Q8 groups of 16 against as stored")
    p.add_argument("--tiles", action="store_true", help="instead: Q4_K / Q6_K as stored, as tiles and dense")
    p.add_argument("--int4-tiles", action="store_true", help="instead: int4 and Q8 as packed rows, as tiles and dense")
    p.add_argument("--kinds", nargs="+", default=["int4", "q8_0", "q5_k", "q6_k", "q6_k_blocks", "int8-group"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--no-dense", action="store_true", help="skip the dequantize + GEMM column")
    p.add_argument("--cpu-time", action="store_true",
                   help="one thread, timed by its CPU time (steadier than wall time on a shared machine)")
    args = p.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.thread_time
        args.threads = [1]
        torch.set_num_threads(1)
    if paged_attention() is None or quantized_gemv() is None or q6_k_gemv() is None:
        sys.exit("the native kernels could not be built (a C++ compiler is needed)")
    if args.q6_k:
        torch.set_num_threads(args.threads[0])
        print(f"{args.threads[0]} thread(s), medians of {args.repeats}, random data")
        print(q6_k_table(args.rows, args.repeats))
        return
    if args.tiles:
        if q4_k_gemv() is None:
            sys.exit("the native kernels could not be built (a C++ compiler is needed)")
        write_tiles_report(args, "tiles",
                           "Q4_K and Q6_K tiles against the blocks as stored (`benchmarks/kernels.py --tiles`)",
                           "Qwen2.5-Coder-1.5B Q4_K_M's shapes, random data", tiles_table)
        return
    if args.int4_tiles:
        write_tiles_report(args, "int4-tiles",
                           "int4 and Q8 tiles against the packed rows (`benchmarks/kernels.py --int4-tiles`)",
                           "SmolLM2-135M's int4 projections (groups of 32), random data, cycling over 30 copies (a "
                           "decode step's weights come from memory), and its Q8_0 LM head", int4_tiles_table)
        return
    if args.projections is not None:
        print(projections_table(args.projections or list(MODELS), args.kinds, args.rows, args.repeats,
                                not args.no_dense))
        return
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        first = len(rows)
        for batch, context in [(1, 600), (1, 2000), (8, 600), (64, 300), (256, 200)]:
            ours, theirs = attention_case(batch, context, args.repeats)
            rows.append((threads, f"paged attention, {batch} × {context} tokens, one layer", ours, theirs, "gather + matmul"))
        for tokens, dtype in [(256, torch.float32), (512, torch.float32), (512, torch.bfloat16),
                              (2048, torch.bfloat16)]:
            ours, theirs = prefill_attention_case([tokens], dtype, args.repeats)
            rows.append((threads, f"prefill attention, {tokens} tokens, {str(dtype).removeprefix('torch.')}, one "
                                  "layer", ours, theirs, "scaled_dot_product_attention"))
        for count, shortest, longest in [(32, 256, 512), (128, 16, 64)]:
            ours, theirs = prefill_attention_case(packed_prompts(count, shortest, longest), torch.float32,
                                                  args.repeats)
            rows.append((threads, f"prefill attention, {count} prompts of {shortest}-{longest} tokens in one step, "
                                  "float32, one layer", ours, theirs, "scaled_dot_product_attention per prompt"))
        for n in (1, 2, 4, 6, 8):
            ours, theirs = projections_case(n, args.repeats)
            rows.append((threads, f"int4 projections of 30 layers, {n} row(s)", ours, theirs, "_weight_int4pack_mm"))
        for n in (1, 2, 4, 6, 8):
            ours, theirs = lm_head_case(n, args.repeats)
            rows.append((threads, f"LM head 49152 × 576, {n} row(s)", ours, theirs, "_weight_int8pack_mm"))
        print(*rows[first:], sep="\n", flush=True)
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
