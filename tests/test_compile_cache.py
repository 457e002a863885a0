"""The compiled decode step is kept between starts (inferno/worker/compile_cache.py): a second process loads both
graphs from the compile cache instead of compiling them, and computes the same bits; a cache whose files were cut
short is survived (compiled afresh, same bits); another model file of the same shapes reuses the graphs (its
weights are inputs, not constants) yet gets its own results. Each start is a new process on a tiny random GGUF."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferno.kernels import paged_attention
from tiny_gguf import T, write_tiny_gguf

pytestmark = pytest.mark.skipif(paged_attention() is None, reason="the compiled decode step needs the native kernel")

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


def compiled_graphs(result: dict) -> int:
    """Graphs inductor compiled (rather than loaded from its cache) in that process."""
    return result["counters"].get("inductor", {}).get("fxgraph_cache_miss", 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """Two Q4_1 models (the default model's type: tiles in the compiled step) of the same shapes, other weights."""
    folder = tmp_path_factory.mktemp("models")
    return (write_tiny_gguf(folder / "a.gguf", T.Q4_1, tied=False, seed=1),
            write_tiny_gguf(folder / "b.gguf", T.Q4_1, tied=False, seed=2))


@pytest.fixture(scope="module")
def first_start(models, tmp_path_factory) -> tuple[Path, dict]:
    cache = tmp_path_factory.mktemp("compile-cache")
    result = start(models[0], cache)
    assert compiled_graphs(result) == 2  # an empty cache: both graphs compiled
    return cache, result


def test_second_start_loads_the_compiled_step_and_gets_the_same_bits(models, first_start):
    cache, first = first_start
    second = start(models[0], cache)
    assert compiled_graphs(second) == 0
    assert second["counters"]["inductor"]["fxgraph_cache_hit"] == 2
    assert "from the compile cache" in second["log"]
    assert second["compiled"] == first["compiled"]


def test_another_model_of_the_same_shapes_and_another_pool_size_reuse_the_graphs(models, first_start):
    """Another file's weights (inputs of the graphs, not constants) get their own results; a KV pool of 1280 blocks
    instead of 1024 (the pool follows the memory available at each start) is made with the same capacity."""
    cache, first = first_start
    other = start(models[1], cache, engines="both", kv_cache_mib=20)
    assert compiled_graphs(other) == 0
    assert other["compiled"] == other["eager"]  # its own weights, bit for bit
    assert other["compiled"] != first["compiled"]


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
    assert compiled_graphs(result) >= 1
