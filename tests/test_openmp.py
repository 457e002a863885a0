"""OpenMP pools when several threads run ops (inferno/openmp.py): the thread that loaded the model gives its workers
back, a helper thread runs its ops without a pool of its own."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir() or not torch.backends.openmp.is_available(),
                                reason="counts threads through Linux's /proc, of PyTorch's OpenMP runtime")

# child processes, so that no other test's threads or pools are seen: threads are told apart by their OS ids (a
# thread of the process that starts or ends meanwhile changes a count, not which ids are new)
SCRIPT = textwrap.dedent("""
    import json, os, threading, time, torch
    from inferno.openmp import release_thread_pool, run_ops_on_this_thread
    def threads(): return set(os.listdir("/proc/self/task"))
    def parallel_work(): torch.ones(1 << 23).add_(1)  # large enough for a parallel region
    torch.set_num_threads(4)
    before = threads()
    parallel_work()
    workers = threads() - before
    release_thread_pool()
    deadline = time.monotonic() + 5
    while workers & threads() and time.monotonic() < deadline:  # they exit as they are released
        time.sleep(0.01)
    result = {"workers": len(workers), "left": len(workers & threads())}
    def helper():
        before = threads()
        run_ops_on_this_thread()
        parallel_work()
        result["helper's workers"] = len(threads() - before)
        result["helper's count"] = torch.get_num_threads()
    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    result["main's count"] = torch.get_num_threads()
    print(json.dumps(result))
""")


def test_pools_released_and_not_started():
    result = json.loads(subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                                       check=True).stdout)
    assert result["workers"] == 3  # 4 threads: the main one and 3 workers
    assert result["left"] == 0
    assert result["helper's workers"] == 0 and result["helper's count"] == 1 and result["main's count"] == 4


ENGINE_SCRIPT = textwrap.dedent("""
    import os, torch
    from inferno.config import EngineConfig
    from inferno.engine.llm_engine import LLMEngine
    def threads(): return set(os.listdir("/proc/self/task"))
    engine = LLMEngine(EngineConfig(num_threads=4, enforce_eager=True, max_model_len=256, kv_cache_memory=16 << 20))
    engine.wait_for_warm_up()  # its thread (and any pool of its own) is gone
    before = threads()
    torch.ones(1 << 23).add_(1)
    print(len(threads() - before))
""")


def test_the_engine_gives_the_loading_threads_workers_back():
    """Loading ran parallel work on this thread; once the engine is built, the next parallel region here has to
    start its workers again (3 of them with 4 threads): whichever thread steps the engine is the only one with a
    pool, as AsyncLLM's engine thread in `inferno serve`."""
    result = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT], capture_output=True, text=True, check=True)
    assert int(result.stdout.split()[-1]) == 3
