"""The compiled decode step is kept between starts (inferno/worker/compile_cache.py): a second process loads both
graphs precompiled instead of tracing and compiling them, warms up in a fraction of the first's time and computes
the same bits; a cache whose files were cut short, or whose precompiled step was damaged, is survived (compiled
afresh, same bits); another model file of the same shapes reuses the graphs (its weights are inputs, not constants)
yet gets its own results. Each start is a new process on a tiny random GGUF."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inferno.layers.quantization.super_blocks import ShardedLinear
from inferno.loader.model_loader import load_model
from inferno.worker.compile_cache import (precompiled_key, read_precompiled, stable_block_capacity, structure,
                                          write_precompiled)
from inferno.worker.kv_cache import AUTO_KV_CACHE_FRACTION, total_memory
from inferno.worker import tiles
from native_kernels import needs_kernels
from tiny_gguf import T, write_tiny_gguf

pytestmark = needs_kernels  # the compiled decode step calls the native kernels

ROOT = Path(__file__).resolve().parent.parent
START = """
import json, logging, sys
from torch._dynamo.utils import counters
from inferno import LLM, SamplingParams
logging.basicConfig(level=logging.INFO)
params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
engines = {"compiled": False, "eager": True} if sys.argv[2] == "both" else {"compiled": False}
result = {}
for name, enforce_eager in engines.items():
    llm = LLM(sys.argv[1], kv_cache_memory=int(sys.argv[3]) << 20, enable_prefix_caching=False,
              enforce_eager=enforce_eager)
    result[name + "_ready"] = llm.llm_engine.model_runner.wait_for_warm_up()
    out = llm.generate(["def fibonacci(n):", "The capital"], params, use_tqdm=False)
    result[name] = [[o.outputs[0].token_ids,
                     [{str(t): p.logprob for t, p in lp.items()} for lp in o.outputs[0].logprobs]] for o in out]
result["counters"] = {k: dict(v) for k, v in counters.items()}
print(json.dumps(result))
"""


def start(model: Path, cache: Path, engines: str = "compiled", kv_cache_mib: int = 16) -> dict:
    """A new process: the model's compiled (and, with "both", eager) answers, and torch's compile counters."""
    env = dict(os.environ, INFERNO_COMPILE_CACHE=str(cache), PYTHONPATH=str(ROOT))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", START, str(model), engines, str(kv_cache_mib)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["log"] = out.stderr
    assert result["compiled_ready"], out.stderr[-3000:]
    return result


def traced_graphs(result: dict) -> int:
    """Graphs dynamo traced in that process (none where the precompiled step was loaded)."""
    return result["counters"].get("stats", {}).get("unique_graphs", 0)


def warm_up_seconds(result: dict) -> float:
    return float(re.search(r"decode steps run compiled from now on \(warmed up in ([0-9.]+) s", result["log"])[1])


def precompiled_files(cache: Path) -> list[Path]:
    return list(cache.rglob("decode-*.bin"))


# Q4_K_M's mix (the form most GGUF files are downloaded in): Q4_K tiles, Q6_K tiles for attn_v and ffn_down, so the
# fused QKV projection is a ShardedLinear of two types (whose guards once made the precompiled step unloadable)
Q4_K_M = {kind: T.Q4_K for kind in ("token_embd", "output", "attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} | {
    "attn_v": T.Q6_K, "ffn_down": T.Q6_K}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """Two Q4_K_M-style models of the same shapes, other weights."""
    folder = tmp_path_factory.mktemp("models")
    return (write_tiny_gguf(folder / "a.gguf", Q4_K_M, tied=False, seed=1),
            write_tiny_gguf(folder / "b.gguf", Q4_K_M, tied=False, seed=2))


@pytest.fixture(scope="module")
def first_start(models, tmp_path_factory) -> tuple[Path, dict]:
    cache = tmp_path_factory.mktemp("compile-cache")
    result = start(models[0], cache)
    assert traced_graphs(result) == 2  # an empty cache: both graphs traced and compiled
    assert len(precompiled_files(cache)) == 1
    return cache, result


def test_second_start_loads_the_precompiled_step_and_gets_the_same_bits(models, first_start):
    cache, first = first_start
    model = load_model(str(models[0]), torch.float32, quantization="auto").model
    assert any(isinstance(m, ShardedLinear) for m in model.modules())
    second = start(models[0], cache)
    assert traced_graphs(second) == 0  # no dynamo at all
    assert "decode graphs loaded from decode-" in second["log"]
    assert second["compiled"] == first["compiled"]
    assert warm_up_seconds(second) < warm_up_seconds(first) / 2


def test_another_model_of_the_same_shapes_and_another_pool_size_reuse_the_graphs(models, first_start):
    """Another file's weights (inputs of the graphs, not constants) get their own results; a KV pool of 1280 blocks
    instead of 1024 (the pool follows the memory available at each start) is made with the same capacity."""
    cache, first = first_start
    other = start(models[1], cache, engines="both", kv_cache_mib=20)
    assert traced_graphs(other) == 0
    assert other["compiled"] == other["eager"]  # its own weights, bit for bit
    assert other["compiled"] != first["compiled"]


def test_a_damaged_precompiled_step_is_compiled_afresh(models, first_start):
    """A byte changed inside the precompiled step's file (its length unchanged): the checksum catches it, the start
    compiles the step again with the same bits and saves a sound file (before the cut-short test below, which may
    leave files of other keys)."""
    cache, first = first_start
    [path] = precompiled_files(cache)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    result = start(models[0], cache)
    assert "is damaged" in result["log"] and traced_graphs(result) == 2
    assert result["compiled"] == first["compiled"]
    assert read_precompiled(path) is not None


def test_a_cache_cut_short_is_compiled_afresh(models, first_start):
    """Every file of the cache cut to half its size (a disk full, a copy interrupted): the start still compiles
    its decode step, with the same bits, and leaves a whole cache behind (which the other tests may use next)."""
    cache, first = first_start
    files = [p for p in cache.rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert any(p.suffix == ".so" for p in files)
    for path in files:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    result = start(models[0], cache)
    assert result["compiled"] == first["compiled"]
    # compiled afresh: its precompiled step was cut short, or inductor's CPU probes in the folder were (another vector
    # width in the options, another key)
    assert traced_graphs(result) == 2
    assert any(read_precompiled(path) is not None for path in precompiled_files(cache))


def test_the_precompiled_key_follows_shapes_settings_and_options():
    """What a trace depends on changes the key (a tensor's shape or dtype, a layer's setting, an option); the
    weights' values do not (they are inputs of the graphs)."""
    def norm(size: int = 8, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype))
        module.eps = eps
        return module
    options = {"cpp.threads": 2}
    key = precompiled_key(norm(), options)
    assert precompiled_key(norm(), options) == key
    assert structure(norm()) != structure(norm(size=16))
    for other in (precompiled_key(norm(size=16), options), precompiled_key(norm(eps=1e-5), options),
                  precompiled_key(norm(dtype=torch.bfloat16), options), precompiled_key(norm(), {"cpp.threads": 1})):
        assert other != key
    changed = norm()
    with torch.no_grad():
        changed.weight.mul_(3)
    assert precompiled_key(changed, options) == key


def test_the_precompiled_key_does_not_follow_the_operators_a_process_has_called():
    """An operator namespace (the CPU attention backend holds `torch.ops.inferno`) gains attributes as a process
    first calls its operators, and the draft model's key, taken while the target's warm-up called some, differed
    from one start to the next: the key names namespaces and operators, nothing they cache."""
    library = torch.library.Library("inferno_key_test", "DEF")
    library.define("echo(Tensor x) -> Tensor")
    library.impl("echo", lambda x: x.clone(), "CPU")
    holder = torch.nn.Module()
    holder.kernels, holder.scale = torch.ops.inferno_key_test, 2.0
    before = precompiled_key(holder)
    assert torch.equal(torch.ops.inferno_key_test.echo(torch.ones(2)), torch.ones(2))  # its first call
    assert "echo" in vars(torch.ops.inferno_key_test)
    assert precompiled_key(holder) == before
    holder.scale = 3.0
    assert precompiled_key(holder) != before


def test_the_precompiled_key_names_the_layers_that_got_their_tiles(models, monkeypatch):
    """A layer whose tiling failed runs its stored blocks, so its graphs differ: the runner's list of tiled layers
    leaves it out (tiling stops at the failure), and the key differs from the one of the model tiled whole."""
    model = load_model(str(models[0]), torch.float32, quantization="auto").model
    tiled = tiles.make_fast_layouts(model)
    planned = tiles.planned_tiles(model)
    assert len(planned) > 2 and len(tiled) == len(planned) and all(layer.tiles is not None for layer in planned)
    again = load_model(str(models[0]), torch.float32, quantization="auto").model
    failing = tiles.planned_tiles(again)[2]
    monkeypatch.setattr(failing, "make_tiles", lambda: 1 / 0)
    partly = tiles.make_fast_layouts(again)
    assert failing.tiles is None and len(partly) == 2 and partly == tiled[:2]
    assert precompiled_key(again, partly) != precompiled_key(model, tiled)


def test_a_precompiled_file_cut_short_reads_as_none(tmp_path):
    path = tmp_path / "decode-x.bin"
    write_precompiled(path, {"one sequence": b"graph" * 100})
    assert read_precompiled(path) == {"one sequence": b"graph" * 100}
    path.write_bytes(path.read_bytes()[:-10])
    assert read_precompiled(path) is None and not path.exists()


def test_the_cache_capacity_follows_the_machine_not_the_memory_available_at_start_up():
    """Default pools either side of a power of two (the memory available differs from start to start) get caches of
    the same shape, so the second start finds the first one's graphs; a larger pool (a kv_cache_memory beyond the
    default's) still fits."""
    block_bytes = int(total_memory() * AUTO_KV_CACHE_FRACTION) // 40000  # this machine's default pool: ~40000 blocks
    assert stable_block_capacity(32837, block_bytes) == stable_block_capacity(32746, block_bytes) == 1 << 16
    assert stable_block_capacity(70000, block_bytes) == 1 << 17
