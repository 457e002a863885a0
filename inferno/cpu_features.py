"""What the CPU this process runs on can do natively, read once from /proc/cpuinfo (empty elsewhere), and the ISA
levels the native kernels are built for (one library each at install; the process loads the best its CPU runs).

INFERNO_CPU_ISA=avx2 (or scalar, avx2_vnni, avx512) makes inferno use no more than that instruction set on a wider
CPU: the flags above it are left out of `cpu_flags` (the AVX-512 and AMX flags, and AVX-VNNI for `avx2`), so that
the kernel library of that level (or a lower one) is loaded and `isa_cflags` turns the wider flags off in the opt-in
`-march=native` build. With PyTorch's own caps (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, set before torch is
imported) an AVX-512 machine then runs the AVX2 paths end to end: a way to measure them where no AVX2-only CPU is at
hand (the clock, caches and execution units stay this CPU's).

This module imports nothing of inferno: setup.py reads ISA_LEVELS from it before inferno is installed.
"""
import functools
import hashlib
import os
import platform
from dataclasses import dataclass

X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")

# /proc/cpuinfo's names of the x86-64-v3 and -v4 micro-architecture levels' features (abm: LZCNT)
X86_64_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"})
X86_64_V4 = X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class IsaLevel:
    name: str
    cflags: tuple[str, ...]  # what its kernel library is compiled with
    requires: frozenset[str]  # the /proc/cpuinfo flags a CPU needs to run it


# best first; the kernels' #if guards tell these apart (__AVX512VNNI__, __AVX512BF16__, __AVXVNNI__, __AVX2__)
ISA_LEVELS = (
    IsaLevel("avx512", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
             X86_64_V4 | {"avx512_vnni", "avx512_bf16"}),  # Cooper Lake, Sapphire Rapids on; Zen 4 on
    IsaLevel("avx2_vnni", ("-march=x86-64-v3", "-mavxvnni"), X86_64_V3 | {"avx_vnni"}),  # Alder Lake on; Zen 5
    IsaLevel("avx2", ("-march=x86-64-v3",), X86_64_V3),  # Haswell on; Zen 1 on
    IsaLevel("scalar", ("-march=x86-64",) if X86 else (), frozenset()),  # any CPU: the portable reference code
)

# INFERNO_CPU_ISA: (flag prefixes left out, compiler flags that turn them off in a -march=native build)
ISA_CAPS = {
    "scalar": (("avx", "fma", "f16c", "amx", "bmi", "abm", "movbe"),
               ("-mno-avx", "-mno-fma", "-mno-f16c", "-mno-bmi", "-mno-bmi2", "-mno-lzcnt", "-mno-movbe")),
    "avx2": (("avx512", "amx", "avx_vnni"), ("-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile")),
    "avx2_vnni": (("avx512", "amx"), ("-mno-avx512f", "-mno-amx-tile")),
    "avx512": (("amx",), ("-mno-amx-tile",)),
}


def isa_cap() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The flag prefixes left out and the compiler flags of INFERNO_CPU_ISA; nothing left out when it is unset."""
    name = os.environ.get("INFERNO_CPU_ISA", "").lower()
    if name and name not in ISA_CAPS:
        raise ValueError(f"INFERNO_CPU_ISA must be one of {sorted(ISA_CAPS)}, got {name!r}")
    return ISA_CAPS.get(name, ((), ()))


def isa_cflags() -> list[str]:
    return list(isa_cap()[1])


def supported_isa_levels() -> list[IsaLevel]:
    """The ISA levels this CPU runs under INFERNO_CPU_ISA, best first (the last is always `scalar`)."""
    flags = cpu_flags()
    return [level for level in ISA_LEVELS if level.requires <= flags]


def built_isa_levels() -> list[IsaLevel]:
    """The levels an install builds on this machine's architecture: all on x86, `scalar` elsewhere."""
    return list(ISA_LEVELS) if X86 else [ISA_LEVELS[-1]]


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ("flags", "model name", ...); empty where there is none."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def cpu_flags() -> frozenset[str]:
    left_out = isa_cap()[0]
    return frozenset(f for f in cpu_info().get("flags", "").split() if not f.startswith(left_out))


def cpu_key(info: dict[str, str] | None = None) -> str:
    """8 hex digits naming what a `-march=native` build depends on: the architecture, the CPU model and its
    flags (sorted, so that their order does not matter)."""
    info = cpu_info() if info is None else info
    flags = " ".join(sorted(info.get("flags", "").split()))
    text = "\n".join([platform.machine(), info.get("model name", ""), flags])
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def has_native_bfloat16() -> bool:
    """bfloat16 GEMMs run on native instructions (AVX512-BF16 or AMX); elsewhere PyTorch emulates them and float32
    GEMMs are faster."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
