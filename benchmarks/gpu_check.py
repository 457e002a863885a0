"""The stages of benchmarks/gpu_check.sh that are Python: one call per stage, each saving its numbers as it goes to
$GPU_CHECK_WORK/<stage>.json (so a stage killed by its time limit keeps what it measured), and `summary`, which merges
them into one JSON file and prints the table the run ends with.

    env                 versions, the GPU, its copy bandwidth (bytes read + written) and bf16 matmul rate
    models DIR          random bf16 HF folders of SmolLM2-135M's and a ~1B llama's shapes (Llama-3.2-1B's)
    decode MODEL        steps of one model: eager vs CUDA graphs (engine.step() wall time, graph replay GPU time),
                        against the HBM floor (weights + K/V read per step over the measured bandwidth)
    sweep [short]       tile sizes of the Triton decode / prefill attention kernels (short: around the defaults)
    summary OUT_JSON    everything in one file, and the table (benchmarks/gpu_report.py)
    results-md JSON... RESULTS_MD   the `gpu-check` section of RESULTS.md from one run's JSON or more (later win)

GPU_CHECK_DRY=1 runs them on the CPU (Triton's interpreter, tiny shapes) to check the script before a GPU run.
"""
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent / "tests")]  # eager_step; tiny_models' tokenizer
import gpu_report  # noqa: E402  (benchmarks/gpu_report.py: the summary and the RESULTS.md section)

DRY = os.environ.get("GPU_CHECK_DRY") == "1"
DEVICE = "cpu" if DRY else "cuda"
WORK = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/gpu_check"))
GIB = 1 << 30
# llama shapes (tied embeddings, context 8192); the dry run's are tiny
SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}
DRY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024)


class Results:
    """One stage's numbers, saved after every entry."""

    def __init__(self, stage: str):
        self.path = WORK / f"{stage}.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}

    def __setitem__(self, key: str, value) -> None:
        self.data[key] = round(value, 4) if isinstance(value, float) else value
        self.path.write_text(json.dumps(self.data, indent=1))
        print(f"{key}: {self.data[key]}", flush=True)

    def attempt(self, key: str, measure) -> None:
        """results[key] = measure(), or the error it raised (the stage goes on)."""
        try:
            self[key] = measure()
        except Exception:
            self[key + ".error"] = traceback.format_exc(limit=4)[-1500:]


def device_ms(fn) -> float:
    """Median milliseconds of fn(): CUDA events with the L2 flushed between calls (triton's do_bench); wall time on
    the CPU."""
    if DRY:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


# env
def env() -> None:
    import transformers
    import triton
    r = Results("env")
    r["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    r["python"] = sys.version.split()[0]
    r["torch"], r["triton"], r["transformers"] = torch.__version__, triton.__version__, transformers.__version__
    r["cuda_available"] = torch.cuda.is_available()
    if not DRY:
        props = torch.cuda.get_device_properties(0)
        r["gpu"], r["capability"] = torch.cuda.get_device_name(), list(torch.cuda.get_device_capability())
        r["sms"], r["gpu_memory_gib"] = props.multi_processor_count, props.total_memory / GIB
    r.attempt("import_inferno", lambda: __import__("inferno").__name__)
    r.attempt("copy_bandwidth_gbs", copy_bandwidth)
    r.attempt("bf16_matmul_tflops", matmul_rate)


def copy_bandwidth() -> float:
    """GB/s of a device-to-device copy, counting bytes read and written."""
    src = torch.randn((64 << 20) if DRY else GIB, device=DEVICE)  # 4 GiB of float32 on a GPU
    dst = torch.empty_like(src)
    return 2 * src.nbytes / device_ms(lambda: dst.copy_(src)) / 1e6


def matmul_rate() -> float:
    n = 512 if DRY else 8192
    a, b = (torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    return 2 * n ** 3 / device_ms(lambda: a @ b) / 1e9


def bandwidth() -> float:
    """Bytes per second of the env stage's copy (measured again if that stage has none)."""
    gbs = Results("env").data.get("copy_bandwidth_gbs") or copy_bandwidth()
    return gbs * 1e9


# models
def write_models(folder: Path) -> None:
    import transformers
    from tiny_models import write_tokenizer
    r = Results("models")
    for name, shape in SHAPES.items():
        start = time.perf_counter()
        shape = DRY_SHAPE if DRY else shape
        config = transformers.LlamaConfig(**shape, max_position_embeddings=8192, rms_norm_eps=1e-5,
                                          tie_word_embeddings=True, bos_token_id=256, eos_token_id=257)
        torch.manual_seed(0)
        with torch.device(DEVICE):  # random initialisation on the GPU: seconds, not minutes
            model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(folder / name)
        write_tokenizer(folder / name, shape["vocab_size"])
        r[f"{name}.params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
        r[f"{name}.write_s"] = time.perf_counter() - start
        del model


def weight_bytes(folder: Path) -> tuple[int, int]:
    """(bytes of every weight, bytes of the embedding / LM-head matrices) in the folder's safetensors."""
    from safetensors import safe_open
    total = embeddings = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                nbytes = 2 * int(torch.tensor(shape).prod())  # bf16
                total += nbytes
                embeddings += nbytes if name.endswith(("embed_tokens.weight", "lm_head.weight")) else 0
    return total, embeddings


# decode
def decode(model: Path) -> None:
    """Greedy decode steps at batch 1 and 16, eager then with CUDA graphs; the graphs' replay alone; the floor."""
    from eager_step import PROMPT, decode_steps, prefill_step
    from inferno import LLMEngine
    from inferno.config import EngineConfig
    r = Results("decode")
    weights, embeddings = weight_bytes(model)
    config = json.loads((model / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv_per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 2  # bf16 K and V
    steps, bw = (8 if DRY else 64), bandwidth()
    context = len(PROMPT.encode()) + steps // 2  # the byte-level tokenizer: a token per byte
    r["weights_gb"], r["bandwidth_gbs"] = weights / 1e9, bw / 1e9
    for batch in (1, 16):
        r[f"floor_step_ms.b{batch}"] = (weights + batch * context * kv_per_token) / bw * 1e3
    # the graph holds the layers (the embedding lookup reads one row); the LM head runs after it
    r["floor_graph_ms.b1.ctx512"] = (weights - embeddings + 512 * kv_per_token) / bw * 1e3
    for name, eager in (("eager", True), ("graphs", False)):
        if not eager and DRY:
            r["graphs.skipped"] = "no CUDA graphs on the CPU"
            continue
        start = time.perf_counter()
        try:
            engine = LLMEngine(EngineConfig(model=str(model), device=DEVICE, dtype="bfloat16", enforce_eager=eager,
                                            kv_cache_memory=(64 << 20) if DRY else 4 * GIB, max_num_seqs=32))
        except Exception:
            r[f"{name}.start.error"] = traceback.format_exc(limit=4)[-1500:]
            continue
        r[f"{name}.start_s"] = time.perf_counter() - start
        r.attempt(f"{name}.warm_up_s", lambda: timed(lambda: decode_steps(engine, 1, 8)))
        for batch in (1, 16):
            r.attempt(f"{name}.step_ms.b{batch}",
                      lambda: statistics.median(decode_steps(engine, batch, steps)) * 1e3)
        r.attempt(f"{name}.prefill_ms.512", lambda: prefill_step(engine, 512) * 1e3)
        # where the time goes on the GPU: kernels per step and their summed time (the rest: launch gaps, host)
        r.attempt(f"{name}.profile.decode_b1", lambda: decode_step_profile(engine))
        r.attempt(f"{name}.profile.prefill_512", lambda: kernel_profile(lambda: prefill_step(engine, 512, 1), 3))
        if not eager:
            runner = engine.model_runner
            r.attempt("graphs.captured", lambda: sorted(runner.decode_graphs.graphs))
            for batch in (1, 16):
                r.attempt(f"graphs.replay_ms.b{batch}.ctx512", lambda: replay_ms(runner, batch, 512))
            r.attempt("graphs.profile.replay_b1.ctx512", lambda: kernel_profile(runner.decode_graphs.graphs[1].replay))
            r.attempt("lm_head_ms.b1", lambda: device_ms(
                lambda: runner.model.compute_logits(runner.decode_graphs.outputs[1][:1])))
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()


def kernel_profile(fn, repeats: int = 5) -> dict:
    """What one fn() runs on the device (torch.profiler): kernels, their summed time, and the costliest by name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    fn()
    with profile(activities=[ProfilerActivity.CPU if DRY else ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        if not DRY:
            torch.cuda.synchronize()
    kernels: dict[str, tuple[int, float]] = {}
    for event in prof.events():
        if event.device_type == (DeviceType.CPU if DRY else DeviceType.CUDA):
            count, us = kernels.get(event.name, (0, 0.0))
            kernels[event.name] = (count + 1, us + event.time_range.elapsed_us())
    costliest = sorted(kernels.items(), key=lambda item: -item[1][1])[:8]
    return {"kernels": sum(c for c, _ in kernels.values()) / repeats,
            "kernel_ms": round(sum(us for _, us in kernels.values()) / repeats / 1e3, 4),
            "costliest": {name[:70]: f"{c / repeats:g} x {us / c:.1f} us" for name, (c, us) in costliest}}


def decode_step_profile(engine) -> dict:
    """kernel_profile of engine.step() with one request decoding."""
    from eager_step import PROMPT
    from inferno import SamplingParams
    engine.add_request(f"profiled-{time.time()}", PROMPT, SamplingParams(max_tokens=24, temperature=0,
                                                                         ignore_eos=True))
    for _ in range(4):
        engine.step()
    profiled = kernel_profile(engine.step)
    while engine.has_unfinished_requests():
        engine.step()
    return profiled


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def replay_ms(runner, batch: int, context: int) -> float:
    """GPU time of the captured decode step of `batch` rows at `context` keys each (blocks 0.., no K/V written)."""
    graphs = runner.decode_graphs
    blocks = -(-context // runner.block_size)
    graphs.slot_mapping[:batch].fill_(-1)
    graphs.seq_lens[:batch].fill_(context)
    graphs.block_tables[:batch, :blocks] = torch.arange(blocks, dtype=torch.int32, device=graphs.block_tables.device)
    return device_ms(graphs.graphs[batch].replay)


# sweep
SWEEP_TILES = {  # full: every combination; short: around the defaults
    "full": dict(partitions=(256, 512, 1024, 2048), decode_keys=(32, 64, 128), queries=(16, 32, 64, 128),
                 prefill_keys=(32, 64, 128)),
    "short": dict(partitions=(256, 512, 1024), decode_keys=(64, 128), queries=(32, 64, 128), prefill_keys=(32, 64)),
}


def sweep(mode: str = "full") -> None:
    """Decode (flash-decoding partitions, key tiles) and prefill (query and key tiles) attention kernels over tile
    sizes, bf16 cache: a Llama-3.2-1B layer (32 query heads, 8 KV heads, head size 64) and, in the short sweep, a
    Qwen2.5-1.5B one (12 / 2 heads of 128); each output checked against the default tiles'."""
    from inferno.kernels import triton_attention as ta
    r = Results("sweep")
    tiles = SWEEP_TILES[mode]
    defaults = ta.PARTITION_SIZE, ta.DECODE_KEY_TILE, ta.QUERY_TILE, ta.PREFILL_KEY_TILE
    r["default_tiles"] = {"decode": f"{ta.PARTITION_SIZE}.key{ta.DECODE_KEY_TILE}",
                          "prefill": f"{ta.QUERY_TILE}.key{ta.PREFILL_KEY_TILE}"}
    layers = [(4, 2, 64)] if DRY else [(32, 8, 64)] + ([(12, 2, 128)] if mode == "short" else [])
    for heads, kv_heads, head_dim in layers:
        name = "" if head_dim == 64 else f".head{head_dim}"  # head size 64: the first run's keys
        decode_shapes = [(2, 256)] if DRY else [(32, 4096), (1, 16384)]  # (sequences, context)
        for seqs, context in decode_shapes:
            run = decode_run(heads, kv_heads, head_dim, seqs, context)
            reference = run().float()
            combos = [(512, 128)] if DRY else [(p, t) for p in tiles["partitions"] for t in tiles["decode_keys"]]
            for ta.PARTITION_SIZE, ta.DECODE_KEY_TILE in combos:
                key = f"decode{name}.b{seqs}.ctx{context}.part{ta.PARTITION_SIZE}.key{ta.DECODE_KEY_TILE}"
                kv_bytes = 2 * seqs * context * kv_heads * head_dim * 2
                r.attempt(key + ".gbs", lambda: kv_bytes / device_ms(run) / 1e6)
                r.attempt(key + ".max_diff", lambda: (run().float() - reference).abs().max().item())
            ta.PARTITION_SIZE, ta.DECODE_KEY_TILE = defaults[:2]
        chunks, chunk_len = (2, 64) if DRY else (4, 1024)  # prompts with no cached context
        run = prefill_run(heads, kv_heads, head_dim, chunks, chunk_len)
        reference = run().float()
        flops = 4 * chunks * chunk_len * (chunk_len + 1) / 2 * heads * head_dim  # causal QK^T and PV
        combos = [(64, 32)] if DRY else [(m, n) for m in tiles["queries"] for n in tiles["prefill_keys"]]
        for ta.QUERY_TILE, ta.PREFILL_KEY_TILE in combos:
            key = f"prefill{name}.{chunks}x{chunk_len}.query{ta.QUERY_TILE}.key{ta.PREFILL_KEY_TILE}"
            r.attempt(key + ".tflops", lambda: flops / device_ms(run) / 1e9)
            r.attempt(key + ".max_diff", lambda: (run().float() - reference).abs().max().item())
        ta.QUERY_TILE, ta.PREFILL_KEY_TILE = defaults[2:]


def decode_run(heads: int, kv_heads: int, head_dim: int, seqs: int, context: int, block: int = 16):
    """A decode attention call over `seqs` sequences of `context` keys in scattered blocks."""
    from inferno.kernels import triton_attention as ta
    per_seq = context // block
    k, v = (torch.randn(kv_heads, seqs * per_seq, block, head_dim, device=DEVICE, dtype=torch.bfloat16)
            for _ in range(2))
    tables = torch.randperm(seqs * per_seq, device=DEVICE).int().view(seqs, per_seq)
    seq_lens = torch.full((seqs,), context, dtype=torch.int32, device=DEVICE)
    q = torch.randn(seqs, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    return lambda: ta.paged_decode_attention(q, k, v, tables, seq_lens, head_dim ** -0.5)


def prefill_run(heads: int, kv_heads: int, head_dim: int, chunks: int, chunk_len: int, block: int = 16):
    """A prefill attention call over `chunks` prompts of `chunk_len` tokens."""
    from inferno.kernels import triton_attention as ta
    tokens = chunks * chunk_len
    k, v = (torch.randn(kv_heads, tokens // block, block, head_dim, device=DEVICE, dtype=torch.bfloat16)
            for _ in range(2))
    tables = torch.arange(tokens // block, device=DEVICE, dtype=torch.int32).view(chunks, -1)
    starts = torch.arange(0, tokens + 1, chunk_len, device=DEVICE, dtype=torch.int32)
    seq_lens = torch.full((chunks,), chunk_len, dtype=torch.int32, device=DEVICE)
    q = torch.randn(tokens, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    return lambda: ta.paged_prefill_attention(q, k, v, tables, starts, seq_lens, chunk_len, head_dim ** -0.5)


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    WORK.mkdir(parents=True, exist_ok=True)
    {"env": env, "models": lambda: write_models(Path(rest[0])), "decode": lambda: decode(Path(rest[0])),
     "sweep": lambda: sweep(*rest), "summary": lambda: gpu_report.summary(WORK, Path(rest[0]), DRY),
     "results-md": lambda: gpu_report.results_md([Path(p) for p in rest[:-1]], Path(rest[-1]))}[command]()
