"""What the CPU this process runs on can do natively, read once from /proc/cpuinfo (empty elsewhere)."""
import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bfloat16() -> bool:
    """bfloat16 GEMMs run on native instructions (AVX512-BF16 or AMX); elsewhere PyTorch emulates them and float32
    GEMMs are faster."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
