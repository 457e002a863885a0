"""Where the compiled decode step is kept between starts: inductor's own caches (the FX graph cache, with the built
C++ libraries, and the AOTAutograd cache) in a folder of the user's cache directory instead of PyTorch's default,
/tmp/torchinductor_$USER, which a reboot, a container or a tmp cleaner throws away.

Inductor keys every entry by the traced graph, the shapes and dtypes of its inputs, its configuration (our vector
width included: `vector_width_option`) and the torch version; the weights are inputs of the graph, not constants,
so one entry serves every model of the same architecture and shapes, and a changed model file, engine option or
torch gets a new entry by itself. What the key lacks is the CPU: inductor builds its C++ with `-march=native`, and a
home folder can be shared by machines with different CPUs, so the folder is one per CPU (`cpu_key`). Entries are
written to a temporary file and renamed (a concurrent writer is harmless), an unreadable one is skipped with a
warning and rebuilt; an entry whose library fails to load is handled by the model runner (the folder is cleared and
the step compiled afresh: `clear_compile_cache`).
"""
import logging
import os
import shutil
from pathlib import Path

from inferno.cache_dirs import compile_cache_dir

logger = logging.getLogger("inferno")


def use_compile_cache() -> Path:
    """Point inductor's caches at `compile_cache_dir()`, unless TORCHINDUCTOR_CACHE_DIR names a folder of the user's
    (PyTorch writes its default there on first use: that one is replaced); the folder inductor uses."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    folder = compile_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home: PyTorch's default it is
        logger.warning("compile cache folder %s cannot be made (%s); compiling into %s", folder, e,
                       default_cache_dir())
        return Path(default_cache_dir())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


def clear_compile_cache(folder: Path) -> None:
    """Remove every entry of `folder` if it is inferno's (a process still reading one keeps its open files); a
    folder of the user's (TORCHINDUCTOR_CACHE_DIR) is left alone and the compile runs without inductor's caches."""
    if folder != compile_cache_dir():
        import torch._inductor.config
        torch._inductor.config.force_disable_caches = True
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)


def compile_cache_hits() -> int:
    """Graphs this process has loaded from inductor's caches so far (FX graph and AOTAutograd)."""
    from torch._dynamo.utils import counters
    return counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]


def stable_block_capacity(num_blocks: int) -> int:
    """The blocks a CPU KV cache tensor is made with: `num_blocks` rounded up to a power of two. The compiled
    decode step is specialised on the caches' shapes, while the pool's size follows the memory available at start-up,
    which differs at every start (two starts of SmolLM2 here: 27004 and 21810 blocks), so each start compiled anew;
    starts whose pools round to the same power share their graphs. The blocks past the pool (and its scratch block)
    are never touched, and a CPU cache's pages are backed only once touched (`lazily_zeroed`): they cost address
    space, not memory."""
    return 1 << (num_blocks - 1).bit_length()
