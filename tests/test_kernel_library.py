"""The native kernel library as installed: one per ISA level, the best one this CPU runs loaded under INFERNO_CPU_ISA,
no compiler needed to run it, a broken one reported in one line, the scalar level free of x86 intrinsics, and
`inferno env`. (What each level computes: the EACH_ISA_LEVEL tests of the kernel files.)"""
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from inferno.cpu_features import ISA_LEVELS, cpu_info, supported_isa_levels
from inferno.entrypoints.cli import main
from inferno.kernels import kernel_library
from inferno.kernels.library import KERNELS, SOURCES, chosen_library, installed_library
from native_kernels import needs_kernels

ROOT = Path(__file__).resolve().parent.parent

# /proc/cpuinfo flags of a few CPUs, and the level each runs
SAPPHIRE_RAPIDS = ("avx avx2 bmi1 bmi2 f16c fma abm movbe avx_vnni avx512f avx512bw avx512cd avx512dq avx512vl "
                   "avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16")
CPUS = {
    "avx512": SAPPHIRE_RAPIDS,
    "avx2_vnni": "avx avx2 bmi1 bmi2 f16c fma abm movbe avx_vnni",  # Alder Lake
    "avx2": "avx avx2 bmi1 bmi2 f16c fma abm movbe avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni",  # Ice Lake
    "scalar": "sse sse2 sse4_2 avx",  # Sandy Bridge
}


@needs_kernels
def test_the_installed_library_of_the_best_level_this_cpu_runs_is_loaded():
    library = kernel_library()
    assert library is not None, "the native kernels did not load: see the warning above"
    assert library.level == supported_isa_levels()[0].name and library.path.parent == KERNELS
    assert torch.ops.inferno.rms_norm.default is not None


def install_every_level(monkeypatch, folder: Path):
    """Libraries of every level (empty files) in `folder`, as the install's."""
    for level in ISA_LEVELS:
        (folder / f"_kernels_{level.name}.so").touch()
    monkeypatch.setattr("inferno.kernels.library.installed_library", lambda name: folder / f"_kernels_{name}.so")


@pytest.mark.parametrize("level", CPUS)
def test_each_cpu_gets_the_best_level_it_runs(monkeypatch, tmp_path, level):
    monkeypatch.setattr("inferno.cpu_features.cpu_info", lambda: {"flags": CPUS[level]})
    install_every_level(monkeypatch, tmp_path)
    assert chosen_library().level == level


@pytest.mark.parametrize("cap", [level.name for level in ISA_LEVELS])
def test_an_isa_cap_picks_that_level_or_the_best_below_it(monkeypatch, tmp_path, cap):
    monkeypatch.setattr("inferno.cpu_features.cpu_info", lambda: {"flags": SAPPHIRE_RAPIDS})
    install_every_level(monkeypatch, tmp_path)
    monkeypatch.setenv("INFERNO_CPU_ISA", cap)
    assert chosen_library().level == cap
    monkeypatch.setattr("inferno.cpu_features.cpu_info", lambda: {"flags": CPUS["avx2"]})  # no VNNI at all
    assert chosen_library().level == ("scalar" if cap == "scalar" else "avx2")


def test_a_level_missing_from_the_install_runs_the_best_below_it_with_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr("inferno.cpu_features.cpu_info", lambda: {"flags": SAPPHIRE_RAPIDS})
    install_every_level(monkeypatch, tmp_path)
    (tmp_path / "_kernels_avx512.so").unlink()
    monkeypatch.setattr("inferno.kernels.library.installed_library",
                        lambda name: path if (path := tmp_path / f"_kernels_{name}.so").is_file() else None)
    assert chosen_library().level == "avx2_vnni"
    assert "the avx512 library is missing, running the avx2_vnni one" in caplog.text


@needs_kernels
def test_every_level_of_this_architecture_is_installed():
    """A library missing from the install would make its CPUs run a lower level (or the PyTorch paths)."""
    assert all(installed_library(level.name) for level in ISA_LEVELS)


@needs_kernels
def test_an_installed_package_runs_the_native_kernels_without_a_compiler(tmp_path):
    """No gcc, c++ or ninja on PATH: the library loads as built, and torch.utils.cpp_extension is never imported."""
    check = ("import sys, torch\nfrom inferno.kernels import kernel_library, fused_ops\n"
             "assert kernel_library() is not None\n"
             "x, w = torch.randn(3, 64), torch.rand(64) + 0.5\n"
             "ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w\n"
             "torch.testing.assert_close(fused_ops().rms_norm(x, w, 1e-6), ref)\n"
             "print('torch.utils.cpp_extension' in sys.modules)")
    assert not shutil.which("c++", path=str(tmp_path)) and not shutil.which("gcc", path=str(tmp_path))
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(ROOT), "CXX": "", "CC": ""}
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def env_of_a_copy(tmp_path: Path, library: bytes, edited: str | None = None) -> tuple[str, list[str]]:
    """`inferno env` run on a copy of the package holding `library` as its kernel library for this CPU (and
    `edited`, a kernel file, touched after it): its output and its warnings about the kernels."""
    shutil.copytree(ROOT / "inferno", tmp_path / "inferno", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    kernels = tmp_path / "inferno" / "kernels"
    (kernels / kernel_library().path.name).write_bytes(library)
    if edited:
        later = time.time() + 600
        os.utime(kernels / edited, (later, later))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", "from inferno.entrypoints.cli import main; main(['env'])"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return out.stdout, [line for line in out.stderr.splitlines() if "kernel" in line.lower()]


@needs_kernels
def test_a_broken_kernel_library_is_one_line_at_start_up(tmp_path):
    """A library cut short: `inferno env` starts, says in one warning line which slow path runs and how to fix
    it, and reports the kernels as unavailable."""
    out, warnings = env_of_a_copy(tmp_path, kernel_library().path.read_bytes()[:4096])
    assert len(warnings) == 1, warnings
    assert "native CPU kernels unavailable" in warnings[0] and "PyTorch paths" in warnings[0]
    assert "reinstall inferno with a C++ compiler" in warnings[0] and "docs/kernels.md" in warnings[0]
    assert "native kernels: unavailable" in out


@needs_kernels
def test_a_kernel_source_edited_after_the_build_is_one_line_at_start_up(tmp_path):
    out, warnings = env_of_a_copy(tmp_path, kernel_library().path.read_bytes(), edited="fused_ops.cpp")
    assert len(warnings) == 1, warnings
    assert "fused_ops.cpp changed after" in warnings[0] and "make kernels" in warnings[0]
    assert f"native kernels: {kernel_library().level} (" in out  # the old code still runs


def test_inferno_env_reports_what_a_bug_report_needs(capsys):
    main(["env"])
    out = capsys.readouterr().out
    library = kernel_library()
    assert f"PyTorch: {torch.__version__}" in out and f"Python: {sys.version.split()[0]}" in out
    assert cpu_info().get("model name", "") in out
    assert f"native kernels: {library.level} ({library.path})" in out if library else "native kernels: " in out
    assert f"threads: torch {torch.get_num_threads()}" in out
    assert re.search(r"^system: inferno .* \| threads = \d+ \| kernels = \w+ \| ", out, re.M)


TORCH_HEADERS = ["ATen/Parallel.h", "ATen/core/Tensor.h", "ATen/core/dispatch/Dispatcher.h", "ATen/ops/empty.h",
                 "ATen/ops/empty_like.h", "ATen/ops/linear.h", "torch/library.h", "torch/headeronly/util/BFloat16.h", "torch/headeronly/util/Half.h"]


def intrinsics_outside_guards(source: str, empty_torch: Path) -> list[str]:
    """The lines of inferno's kernel files that still use SIMD intrinsics when `source` is preprocessed as for a
    CPU with no SSE at all (the x86 macros past the baseline left undefined, as on aarch64); PyTorch's headers are
    left empty (`empty_torch`), since only inferno's own lines are looked at."""
    # -O2: _mm_prefetch stays a function, not a macro expanding to __builtin_prefetch
    flags = ["-E", "-O2", "-std=c++20", "-march=x86-64", "-U__SSE__", "-U__SSE2__", "-U__MMX__", f"-I{empty_torch}"]
    text = subprocess.run(["c++", *flags, str(KERNELS / source)], capture_output=True, text=True, check=True).stdout
    found, ours = [], False
    for line in text.splitlines():
        if line.startswith("# "):
            ours = str(KERNELS) in line
        elif ours and re.search(r"\b(_mm\w*|__m(64|128|256|512)\w*)\b", line):
            found.append(line.strip())
    return found


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to preprocess with")
def test_the_scalar_level_uses_no_simd_intrinsics_outside_their_isa_guards(tmp_path):
    """What builds on any architecture: with no SIMD macro defined, nothing of the kernel files uses intrinsics
    (immintrin.h itself is included only on x86, see kernel.h)."""
    for header in TORCH_HEADERS:
        (tmp_path / header).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / header).touch()
    found = {source: intrinsics_outside_guards(source, tmp_path) for source in SOURCES}
    assert found == {source: [] for source in SOURCES}


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to preprocess with")
def test_only_ops_cpp_includes_pytorch_beyond_its_header_only_float_types():
    """The kernel bodies, compiled once per ISA level, read none of PyTorch's headers but torch/headeronly's (float16
    and bfloat16): ATen's would double each one's compile time. ops.cpp, compiled once, is all that is torch-facing."""
    from torch.utils.cpp_extension import include_paths
    torch_include = Path(include_paths()[0])
    for source in SOURCES:
        if source == "ops.cpp":
            continue
        flags = ["-M", "-std=c++17", "-march=x86-64", *(f"-I{path}" for path in include_paths())]
        deps = subprocess.run(["c++", *flags, str(KERNELS / source)], capture_output=True, text=True, check=True).stdout
        from_torch = {Path(dep) for dep in deps.replace("\\\n", " ").split() if dep.startswith(str(torch_include))}
        assert from_torch and all(dep.is_relative_to(torch_include / "torch" / "headeronly") for dep in from_torch), \
            (source, sorted(from_torch))

