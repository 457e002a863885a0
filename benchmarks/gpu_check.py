"""The stages of benchmarks/gpu_check.sh that are Python: one call per stage, each saving its numbers as it goes to
$GPU_CHECK_WORK/<stage>.json (so a stage killed by its time limit keeps what it measured), and `summary`, which merges
them into one JSON file and prints the table the run ends with.

    env                 versions, the GPU, its copy bandwidth (bytes read + written) and bf16 matmul rate
    models DIR          random bf16 HF folders of SmolLM2-135M's and a ~1B llama's shapes (Llama-3.2-1B's)
    decode MODEL        steps of one model: eager vs CUDA graphs (engine.step() wall time, graph replay GPU time),
                        against the HBM floor (weights + K/V read per step over the measured bandwidth)
    sweep               tile sizes of the Triton decode / prefill attention kernels
    summary OUT_JSON    everything in one file, and the table

GPU_CHECK_DRY=1 runs them on the CPU (Triton's interpreter, tiny shapes) to check the script before a GPU run.
"""
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from xml.etree import ElementTree

import torch

BENCHMARKS = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent / "tests")]  # eager_step; tiny_models' tokenizer

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
        if not eager:
            runner = engine.model_runner
            r.attempt("graphs.captured", lambda: sorted(runner.decode_graphs.graphs))
            for batch in (1, 16):
                r.attempt(f"graphs.replay_ms.b{batch}.ctx512", lambda: replay_ms(runner, batch, 512))
            r.attempt("lm_head_ms.b1", lambda: device_ms(
                lambda: runner.model.compute_logits(runner.decode_graphs.outputs[1][:1])))
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()


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
def sweep() -> None:
    """Decode (flash-decoding partitions, key tiles) and prefill (query and key tiles) attention kernels of a
    Llama-3.2-1B layer (32 query heads, 8 KV heads, head size 64, bf16 cache) over tile sizes; each output checked
    against the default tiles'."""
    from inferno.kernels import triton_attention as ta
    r = Results("sweep")
    heads, kv_heads, head_dim, block = (4, 2, 64, 16) if DRY else (32, 8, 64, 16)
    defaults = ta.PARTITION_SIZE, ta.KEY_TILE, ta.QUERY_TILE
    r["default_tiles"] = {"decode": f"{ta.PARTITION_SIZE}.key{ta.KEY_TILE}",
                          "prefill": f"{ta.QUERY_TILE}.key{ta.KEY_TILE}"}
    decode_shapes = [(2, 256)] if DRY else [(32, 4096), (1, 16384)]  # (sequences, context)
    for seqs, context in decode_shapes:
        per_seq = context // block
        k, v = (torch.randn(kv_heads, seqs * per_seq, block, head_dim, device=DEVICE, dtype=torch.bfloat16)
                for _ in range(2))
        tables = torch.randperm(seqs * per_seq, device=DEVICE).int().view(seqs, per_seq)
        seq_lens = torch.full((seqs,), context, dtype=torch.int32, device=DEVICE)
        q = torch.randn(seqs, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
        run = lambda: ta.paged_decode_attention(q, k, v, tables, seq_lens, head_dim ** -0.5)  # noqa: E731
        reference = run().float()
        tiles = [(512, 64)] if DRY else [(p, t) for p in (256, 512, 1024, 2048) for t in (32, 64, 128)]
        for ta.PARTITION_SIZE, ta.KEY_TILE in tiles:
            key = f"decode.b{seqs}.ctx{context}.part{ta.PARTITION_SIZE}.key{ta.KEY_TILE}"
            r.attempt(key + ".gbs", lambda: (k.nbytes + v.nbytes) / device_ms(run) / 1e6)
            r.attempt(key + ".max_diff", lambda: (run().float() - reference).abs().max().item())
        ta.PARTITION_SIZE, ta.KEY_TILE = defaults[:2]
    chunks, chunk_len = (2, 64) if DRY else (4, 1024)  # prompts with no cached context
    tokens = chunks * chunk_len
    k, v = (torch.randn(kv_heads, tokens // block, block, head_dim, device=DEVICE, dtype=torch.bfloat16)
            for _ in range(2))
    tables = torch.arange(tokens // block, device=DEVICE, dtype=torch.int32).view(chunks, -1)
    starts = torch.arange(0, tokens + 1, chunk_len, device=DEVICE, dtype=torch.int32)
    seq_lens = torch.full((chunks,), chunk_len, dtype=torch.int32, device=DEVICE)
    q = torch.randn(tokens, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    run = lambda: ta.paged_prefill_attention(q, k, v, tables, starts, seq_lens, chunk_len,  # noqa: E731
                                             head_dim ** -0.5)
    reference = run().float()
    flops = 4 * chunks * chunk_len * (chunk_len + 1) / 2 * heads * head_dim  # causal QK^T and PV
    tiles = [(32, 64)] if DRY else [(m, n) for m in (16, 32, 64, 128) for n in (32, 64, 128)]
    for ta.QUERY_TILE, ta.KEY_TILE in tiles:
        key = f"prefill.{chunks}x{chunk_len}.query{ta.QUERY_TILE}.key{ta.KEY_TILE}"
        r.attempt(key + ".tflops", lambda: flops / device_ms(run) / 1e9)
        r.attempt(key + ".max_diff", lambda: (run().float() - reference).abs().max().item())
    ta.QUERY_TILE, ta.KEY_TILE = defaults[2], defaults[1]


# summary
def summary(out: Path) -> None:
    merged = {"dry_run": DRY, "stages": {}}
    for line in (WORK / "stages.txt").read_text().splitlines() if (WORK / "stages.txt").exists() else []:
        name, rc, seconds = line.split()  # rc "skipped": the budget was spent before the stage
        merged["stages"][name] = {"rc": rc, "seconds": int(seconds), "timed_out": rc in ("124", "137")}
    for file in sorted(WORK.glob("*.json")):
        merged[file.stem] = json.loads(file.read_text())
    if (WORK / "pytest.xml").exists():
        merged["pytest"] = pytest_results(WORK / "pytest.xml")
    out.write_text(json.dumps(merged, indent=1))
    for name, stage in merged["stages"].items():
        print(f"{name:24} rc {stage['rc']:>3} {stage['seconds']:4} s{'  TIMED OUT' if stage['timed_out'] else ''}")
    for section in ("env", "pytest", "throughput_smollm2-135m", "throughput_llama-1b", "decode"):
        for key, value in flatten(merged.get(section, {})):
            print(f"{section}.{key}: {str(value).splitlines()[-1] if value else value}"[:160])
    best = best_tiles(merged.get("sweep", {}))
    for key, value in best.items():
        print(f"sweep best {key}: {value}")


def pytest_results(xml: Path) -> dict:
    cases = ElementTree.parse(xml).getroot().iter("testcase")
    outcome = {}
    for case in cases:
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        outcome[f"{case.get('classname')}::{case.get('name')}"] = kind
    counts = {kind: list(outcome.values()).count(kind) for kind in ("passed", "failure", "error", "skipped")}
    return counts | {"not_passed": sorted(name for name, kind in outcome.items() if kind in ("failure", "error"))}


def flatten(data: dict) -> list[tuple[str, object]]:
    if "throughput" in data:  # throughput.py's --json: a row per engine
        return [(f"{row['engine']}.output_tps", round(row["output_tps"], 1)) for row in data["throughput"]]
    return list(data.items())


def best_tiles(sweep: dict) -> dict[str, str]:
    """The fastest tiles of each swept shape (GB/s of K/V for decode, TFLOP/s for prefill), beside the defaults'."""
    groups: dict[str, dict[str, float]] = {}
    for key, value in sweep.items():
        if key.endswith((".gbs", ".tflops")):
            shape, tiles = key.rsplit(".", 1)[0].split(".part" if ".part" in key else ".query")
            groups.setdefault(shape, {})[tiles] = value
    defaults = sweep.get("default_tiles", {})
    return {shape: f"{max(t, key=t.get)}: {max(t.values()):.3g} (default {defaults.get(shape.split('.')[0])}: "
                   f"{t.get(defaults.get(shape.split('.')[0]))})" for shape, t in groups.items()}


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    WORK.mkdir(parents=True, exist_ok=True)
    {"env": env, "models": lambda: write_models(Path(rest[0])), "decode": lambda: decode(Path(rest[0])),
     "sweep": sweep, "summary": lambda: summary(Path(rest[0]))}[command]()
