"""`inferno env`: what a bug report needs to know about the machine and the install (as `vllm collect-env` and
llama.cpp's system line): versions, the CPU and its SIMD flags, the ISA level of the native kernel library this
process loads, threads, cache folders, GPUs and the environment variables that change inferno's paths."""
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

import torch

from inferno.cpu_features import ISA_LEVELS, cpu_flags, cpu_info, supported_isa_levels
from inferno.cache_dirs import compile_cache_dir
from inferno.kernels import kernel_cache_dir, kernel_library
from inferno.kernels.library import installed_library, kernels_disabled

SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve")
ENV_PREFIXES = ("INFERNO_", "OMP_", "MKL_", "ATEN_CPU_CAPABILITY", "ONEDNN_", "TORCHINDUCTOR_", "CUDA_VISIBLE_DEVICES",
                "HF_HOME")


def inferno_version() -> str:
    try:
        return metadata.version("inferno")
    except metadata.PackageNotFoundError:
        return "not installed"


def kernels_line() -> str:
    if kernels_disabled():
        return "disabled (INFERNO_DISABLE_CPP_KERNELS=1): PyTorch paths"
    library = kernel_library()
    return f"{library.level} ({library.path})" if library else "unavailable: PyTorch paths (see the warning above)"


def cap_note() -> str:
    cap = os.environ.get("INFERNO_CPU_ISA")
    return f" (capped by INFERNO_CPU_ISA={cap})" if cap else ""


def gpu_lines() -> list[str]:
    if not torch.cuda.is_available():
        return ["GPU: none (CUDA not available)"]
    return [f"GPU {i}: {torch.cuda.get_device_name(i)}, CUDA {torch.version.cuda}"
            for i in range(torch.cuda.device_count())]


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def system_line() -> str:
    """One line, as llama.cpp's system_info: what the numbers of a report ran on."""
    flags = cpu_flags()
    simd = " | ".join(f"{flag.upper()} = {int(flag in flags)}" for flag in SIMD_FLAGS[:11])
    library = kernel_library()
    return (f"inferno {inferno_version()} | torch {torch.__version__} | threads = {torch.get_num_threads()} | "
            f"kernels = {library.level if library else 'none'} | {simd}")


def report() -> list[str]:
    info = cpu_info()
    installed = [level.name for level in ISA_LEVELS if installed_library(level.name)]
    lines = [
        f"inferno: {inferno_version()} ({Path(__file__).resolve().parents[1]})",
        f"Python: {platform.python_version()} ({sys.executable})",
        f"PyTorch: {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()})",
        f"OS: {platform.platform()}",
        f"CPU: {info.get('model name', platform.processor() or platform.machine())}, {cpu_count()} usable "
        f"of {os.cpu_count()} logical CPUs",
        f"CPU SIMD flags: {' '.join(f for f in SIMD_FLAGS if f in cpu_flags()) or 'none'}{cap_note()}",
        f"ISA levels: this CPU runs {', '.join(level.name for level in supported_isa_levels())}; "
        f"installed {', '.join(installed) or 'none'}",
        f"native kernels: {kernels_line()}",
        f"threads: torch {torch.get_num_threads()} (intra-op), {torch.get_num_interop_threads()} (inter-op)",
        f"kernel cache (INFERNO_NATIVE_KERNELS=1 builds): {kernel_cache_dir()}",
        f"compiled decode steps: {os.environ.get('TORCHINDUCTOR_CACHE_DIR') or compile_cache_dir()}",
        *gpu_lines(),
        "environment: " + (" ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                    if k.startswith(ENV_PREFIXES) and "KEY" not in k and "TOKEN" not in k) or "-"),
        "CPU flags: " + info.get("flags", info.get("Features", "-")),
        "system: " + system_line(),
    ]
    return lines


def run_env() -> None:
    print("\n".join(report()))
