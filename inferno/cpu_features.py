"""What the CPU this process runs on can do natively, read once from /proc/cpuinfo (empty elsewhere).

INFERNO_CPU_ISA=avx2 (or avx2_vnni) makes inferno use no more than that instruction set on a wider CPU: the
AVX-512 and AMX flags (and AVX-VNNI for `avx2`) are left out of `cpu_flags`, and the native kernels are built without
them (`isa_cflags`). With PyTorch's own caps (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, set before torch is
imported) an AVX-512 machine then runs the AVX2 paths end to end: a way to measure them where no AVX2-only CPU is at
hand (the clock, caches and execution units stay this CPU's).
"""
import functools
import hashlib
import os
import platform

# INFERNO_CPU_ISA: (flags left out, compiler flags that turn them off)
ISA_CAPS = {
    "avx2": (("avx512", "amx", "avx_vnni"), ("-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile")),
    "avx2_vnni": (("avx512", "amx"), ("-mno-avx512f", "-mno-amx-tile")),
}


def isa_cap() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The flag prefixes left out and the compiler flags of INFERNO_CPU_ISA; nothing left out when it is unset."""
    name = os.environ.get("INFERNO_CPU_ISA", "").lower()
    if name and name not in ISA_CAPS:
        raise ValueError(f"INFERNO_CPU_ISA must be one of {sorted(ISA_CAPS)}, got {name!r}")
    return ISA_CAPS.get(name, ((), ()))


def isa_cflags() -> list[str]:
    return list(isa_cap()[1])


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
