"""What the CPU this process runs on can do natively, read once from /proc/cpuinfo (empty elsewhere)."""
import functools
import hashlib
import platform


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
    return frozenset(cpu_info().get("flags", "").split())


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
