"""Where the compiled decode step is kept between starts: inductor's own caches (the FX graph cache, with the built
C++ libraries, and the AOTAutograd cache) in a folder of the user's cache directory instead of PyTorch's default,
/tmp/torchinductor_$USER, which a reboot, a container or a tmp cleaner throws away; beside them, the precompiled
decode step (worker/compiled_decode.py), which a start loads without tracing the model.

Inductor keys every entry by the traced graph, the shapes and dtypes of its inputs, its configuration (our vector
width included: `vector_width_option`) and the torch version; the weights are inputs of the graph, not constants,
so one entry serves every model of the same architecture and shapes, and a changed model file, engine option or
torch gets a new entry by itself. What the key lacks is the CPU: inductor builds its C++ with `-march=native`, and a
home folder can be shared by machines with different CPUs, so the folder is one per CPU (`cpu_key`). Entries are
written to a temporary file and renamed (a concurrent writer is harmless), an unreadable one is skipped with a
warning and rebuilt; an entry whose library fails to load is handled by the model runner (the folder is cleared and
the step compiled afresh: `clear_compile_cache`).

The precompiled step skips what inductor's key is made of (the traced graph), so its own key is everything the
trace depends on (`precompiled_key`): inferno's code and kernel library, torch and Python, the compile options, and
the structure of the model and its attention backend down to every tensor's shape, dtype and strides and every
attribute the layers read (the model's configuration, and the engine's as they hold it: KV cache dtype and capacity,
backend, quantization); not the weights' values, which are inputs of the graphs, nor the tiles, which the warm-up
makes after the lookup (the caller names the layers planned to have them). Its file carries a checksum: a file cut
short or damaged is removed and compiled afresh.
"""
import dataclasses
import enum
import functools
import hashlib
import inspect
import logging
import os
import pickle
import shutil
import sys
import threading
import types
from pathlib import Path

import torch

from inferno.cache_dirs import compile_cache_dir
from inferno.kernels import kernel_library
from inferno.worker.kv_cache import AUTO_KV_CACHE_FRACTION, total_memory

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


def stable_block_capacity(num_blocks: int, block_bytes: int) -> int:
    """The blocks a CPU KV cache tensor is made with: a power of two no smaller than `num_blocks` nor than the
    largest default pool of this machine (AUTO_KV_CACHE_FRACTION of its RAM in blocks of `block_bytes`). The compiled
    decode step is specialised on the caches' shapes, while the default pool's size follows the memory available at
    start-up, which differs at every start (two starts of SmolLM2 on a 24 GiB machine: 32837 and 32746 blocks, either
    side of 2^15: rounding the pool alone still compiled anew), so the capacity follows the machine's RAM instead. The
    blocks past the pool (and its scratch block) are never touched, and a CPU cache's pages are backed only once
    touched (`lazily_zeroed`): they cost address space, not memory."""
    largest_default = int(total_memory() * AUTO_KV_CACHE_FRACTION) // block_bytes
    return 1 << (max(num_blocks, largest_default, 1) - 1).bit_length()


PRECOMPILED_HEADER = b"inferno precompiled decode step 1\n"


def precompiled_path(folder: Path, key: str) -> Path:
    return folder / f"decode-{key}.bin"


def precompiled_key(*parts: object) -> str:
    """A digest of what a precompiled step's trace depends on: inferno's code, torch, Python, INFERNO_CPU_ISA and
    the structure of each of `parts` (the model, its attention backend, the options)."""
    digest = hashlib.sha256()
    for part in (code_digest(), torch.__version__, sys.version, os.environ.get("INFERNO_CPU_ISA", ""),
                 *map(structure, parts)):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]


@functools.cache
def code_digest() -> str:
    """inferno's Python code (what is traced) and the kernel library this process loaded (what the graphs call)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    if (library := kernel_library()) is not None:
        stat = library.path.stat()
        digest.update(f"{library.path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


SCALARS = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum, type(None))


def structure(value: object, depth: int = 0) -> str:
    """`value` as a trace sees it, without tensor contents: tensors by dtype, shape, strides and device; modules by
    each submodule's class and attributes; plain values by repr; Python modules and operators by name (an operator
    namespace's attributes grow with the operators a process has called so far: two starts of a draft model, whose
    attention backend holds `torch.ops.inferno`, got two keys); objects by class and attributes (6 levels deep)."""
    if isinstance(value, torch.Tensor):
        return f"T({value.dtype},{tuple(value.shape)},{value.stride()},{value.device.type})"
    if isinstance(value, torch.nn.Module):
        return "M(" + ";".join(f"{name}={type(module).__qualname__}{structure(attributes(module), depth + 1)}"
                               for name, module in value.named_modules()) + ")"
    if isinstance(value, SCALARS):
        return repr(value)
    if isinstance(value, types.ModuleType):  # by name (torch.ops.inferno among them): what it holds is code
        return f"module:{value.__name__}"
    if isinstance(value, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):  # by name, not their lookup caches
        return repr(value)
    if depth > 6:
        return type(value).__qualname__
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(structure(v, depth + 1) for v in value) + "]"
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(structure(v, depth + 1) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k!r}:{structure(v, depth + 1)}" for k, v in value.items()) + "}"
    if inspect.isroutine(value) or isinstance(value, type):
        return f"{type(value).__qualname__}:{getattr(value, '__qualname__', '')}"
    return type(value).__qualname__ + structure(attributes(value), depth + 1)


def attributes(value: object) -> dict:
    """An object's attributes (a module's tensors and settings, without its submodules, listed by `structure`, and
    without the buffers the warm-up makes: `QuantizedLinear.warm_up_buffers`)."""
    if dataclasses.is_dataclass(value):
        return {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
    fields = dict(getattr(value, "__dict__", {}))
    fields.pop("_modules", None)
    if made_later := getattr(type(value), "warm_up_buffers", ()):  # tiles: the key names the layers to have them
        fields["_buffers"] = {k: v for k, v in fields["_buffers"].items() if k not in made_later}
    return fields


def read_precompiled(path: Path) -> dict[str, bytes] | None:
    """The serialized graphs in `path`; None where there is none, or it is damaged (then removed, with a warning)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning("the precompiled decode step %s cannot be read (%s); compiling it", path, e)
        return None
    start = len(PRECOMPILED_HEADER) + 32
    if data[:len(PRECOMPILED_HEADER)] != PRECOMPILED_HEADER or hashlib.sha256(data[start:]).digest() != \
            data[len(PRECOMPILED_HEADER):start]:
        logger.warning("the precompiled decode step %s is damaged (cut short?); compiling it afresh", path)
        path.unlink(missing_ok=True)
        return None
    return pickle.loads(data[start:])


def write_precompiled(path: Path, graphs: dict[str, bytes]) -> None:
    """Written to a temporary file and renamed into place: a concurrent start reads the whole of one or the other."""
    payload = pickle.dumps(graphs)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_native_id()}")
    try:
        temporary.write_bytes(PRECOMPILED_HEADER + hashlib.sha256(payload).digest() + payload)
        os.replace(temporary, path)
    except OSError as e:  # a full or read-only disk: the next start compiles again
        logger.warning("the precompiled decode step cannot be saved in %s (%s)", path.parent, e)
        temporary.unlink(missing_ok=True)
