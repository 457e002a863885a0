"""The native kernel library: the kernel files (*.cpp here) compiled at install by setup.py into one library per ISA
level of inferno/cpu_features.py, `_kernels_<level>*.so` beside this file (the kernel bodies built for that level,
ops.cpp's torch-facing registration built once and linked into each). A process loads the best level its CPU
runs under INFERNO_CPU_ISA (only one: each registers the same `torch.ops.inferno` operators), so no start compiles
C++. INFERNO_NATIVE_KERNELS=1 instead builds one for this very CPU (`-march=native`, cached under
`kernel_cache_dir()`); INFERNO_DISABLE_CPP_KERNELS=1 runs the PyTorch paths. A library that cannot be loaded is one
warning naming the slow path and the fix."""
import functools
import hashlib
import importlib.machinery
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from inferno.cpu_features import ISA_LEVELS, cpu_key, isa_cflags, supported_isa_levels

logger = logging.getLogger("inferno")
KERNELS = Path(__file__).parent
SOURCES = tuple(sorted(path.name for path in KERNELS.glob("*.cpp")))
FIX = ("fix: reinstall inferno with a C++ compiler (`pip install --no-build-isolation -e .` in its folder; "
       "docs/kernels.md)")


@dataclass(frozen=True)
class KernelLibrary:
    level: str  # an ISA level's name, or "native" (INFERNO_NATIVE_KERNELS=1)
    path: Path


class KernelsUnavailable(RuntimeError):
    pass


def kernels_disabled() -> bool:
    return os.environ.get("INFERNO_DISABLE_CPP_KERNELS") == "1"


def native_build_requested() -> bool:
    return os.environ.get("INFERNO_NATIVE_KERNELS") == "1"


def installed_library(level: str) -> Path | None:
    """The library of ISA level `level` that the install built, if it did."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (path := KERNELS / f"_kernels_{level}{suffix}").is_file():
            return path
    return None


def chosen_library() -> KernelLibrary:
    """The best installed library this CPU runs (under INFERNO_CPU_ISA), or the opt-in native build."""
    if native_build_requested():
        return native_library()
    supported = supported_isa_levels()
    for level in supported:
        if path := installed_library(level.name):
            if level != supported[0]:
                logger.warning("native kernels: the %s library is missing, running the %s one; %s",
                               supported[0].name, level.name, FIX)
            if edited := sources_edited_after(path):
                logger.warning("native kernels: %s changed after %s was built, which runs the old code; rebuild: "
                               "`make kernels` (or `pip install -e .`)", ", ".join(edited), path.name)
            return KernelLibrary(level.name, path)
    built = [level.name for level in ISA_LEVELS if installed_library(level.name)]
    raise KernelsUnavailable(f"no kernel library for this CPU in {KERNELS}; built: {', '.join(built) or 'none'}")


def check_not_cut_short(library: Path):
    """Raises where an ELF library ends before its section headers (an install or build interrupted): loading it
    would die of SIGBUS instead of raising."""
    with open(library, "rb") as f:
        header = f.read(64)
    if header[:5] != b"\x7fELF\x02":  # 64-bit ELF; dlopen itself rejects what is not a library
        return
    order = "little" if header[5] == 1 else "big"
    sections_offset = int.from_bytes(header[0x28:0x30], order)
    sections_end = sections_offset + int.from_bytes(header[0x3A:0x3C], order) * int.from_bytes(header[0x3C:0x3E], order)
    if library.stat().st_size < sections_end:
        raise KernelsUnavailable(f"{library.name} is cut short ({library.stat().st_size} of {sections_end} bytes)")


def sources_edited_after(library: Path) -> list[str]:
    """The kernel sources edited after `library` was built (with a minute's slack: a wheel's files are written in
    any order)."""
    built = library.stat().st_mtime
    return [path.name for path in sorted(KERNELS.iterdir())
            if path.suffix in (".cpp", ".h") and path.stat().st_mtime > built + 60]


@functools.cache
def load_kernel_library() -> KernelLibrary | None:
    """Loads the chosen library once per process (its operators register on load); None, with one warning, when
    there is none or it cannot be loaded, and silently under INFERNO_DISABLE_CPP_KERNELS=1."""
    if kernels_disabled():
        return None
    try:
        library = chosen_library()
        check_not_cut_short(library.path)
        torch.ops.load_library(str(library.path))
    except Exception as e:  # missing, built against another torch, cut short: keep serving on the PyTorch path
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        logger.warning("native CPU kernels unavailable (%s): running the slow PyTorch paths (dequantize + F.linear, "
                       "PyTorch attention and elementwise ops); %s", reason, FIX)
        return None
    return library


# ---- the opt-in build for this very CPU ----

def kernel_cache_dir() -> Path:
    """INFERNO_KERNEL_CACHE, else inferno/kernels under XDG_CACHE_HOME (~/.cache)."""
    if os.environ.get("INFERNO_KERNEL_CACHE"):
        return Path(os.environ["INFERNO_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inferno" / "kernels"


def extension_name(name: str, sources: tuple[str, ...], cflags: list[str]) -> str:
    """`name` keyed by the CPU and by what the build compiles: a `-march=native` build cached in the home folder,
    which can outlive the CPU it was built for (a home moved or shared between machines), is rebuilt on another CPU
    instead of dying there on an illegal instruction, and a changed source, header, flag or torch is rebuilt too."""
    digest = hashlib.sha256(" ".join([*cflags, torch.__version__]).encode())
    for path in [*(KERNELS / source for source in sources), *sorted(KERNELS.glob("*.h"))]:
        digest.update(path.read_bytes())
    return f"{name}_{cpu_key()}_{digest.hexdigest()[:12]}"


def native_library() -> KernelLibrary:
    """The kernels built with `-march=native` (and INFERNO_CPU_ISA's caps) on first use, cached; a cached build
    loads without importing cpp_extension (about 0.15 s of a start-up)."""
    cflags = ["-O3", "-march=native", *isa_cflags(), "-fopenmp"]
    full_name = extension_name("inferno_kernels_native", SOURCES, cflags)
    folder = kernel_cache_dir() / full_name
    library = folder / f"{full_name}.so"
    if not library.is_file():
        from torch.utils import cpp_extension
        folder.mkdir(parents=True, exist_ok=True)
        logger.info("building the native kernels for this CPU in %s (a few minutes, once)", folder)
        cpp_extension.load(name=full_name, sources=[str(KERNELS / source) for source in SOURCES],
                           extra_cflags=cflags, extra_ldflags=["-fopenmp"], build_directory=str(folder),
                           is_python_module=False, verbose=False)
    return KernelLibrary("native", library)
