"""Build llama.cpp's own tools (llama-bench, llama-batched-bench, llama-server), the peer of benchmarks/vs_llamacpp.py.

The sources are the llama.cpp vendored in the llama-cpp-python sdist (`pip download --no-binary :all:`), so the peer
is the same code llama-cpp-python runs, minus its Python loop. The build names this CPU's instruction sets
explicitly (GGML_NATIVE=OFF; SSE4.2/AVX/AVX2/BMI2/FMA/F16C/AVX-VNNI/AVX-512 F/VBMI/VNNI/BF16 as /proc/cpuinfo
lists them) and never AMX: llama.cpp's AMX path died with SIGILL on an AMX Xeon of this project (`tileloadd` in an
OpenMP worker, any prompt longer than one token), so AMX CPUs get their AVX-512 build and the report says so.

Static binaries are cached under $XDG_CACHE_HOME/inferno/llama.cpp/<version>-<cpu key>/bin (INFERNO_LLAMACPP_CACHE
overrides the root), built once per machine: about 10 minutes on 2 idle cores (over an hour on 2 cores that other
work keeps busy); a second call returns at once. A lock file serialises concurrent builders; a half-finished build
never counts (the bin folder appears by rename), and an interrupted one goes on where it stopped.

    python benchmarks/build_llamacpp.py            # build if needed, print the bin folder
    nohup python benchmarks/build_llamacpp.py > /tmp/llamacpp-build.log 2>&1 &   # in the background
"""
import argparse
import fcntl
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors llama.cpp
TOOLS = ("llama-bench", "llama-batched-bench", "llama-server")
# /proc/cpuinfo flag -> ggml CMake option
ISA_OPTIONS = {"sse4_2": "GGML_SSE42", "avx": "GGML_AVX", "avx2": "GGML_AVX2", "bmi2": "GGML_BMI2", "fma": "GGML_FMA",
               "f16c": "GGML_F16C", "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512",
               "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16"}
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


@dataclass(slots=True)
class Isa:
    flags: list[str]  # the /proc/cpuinfo flags of ISA_OPTIONS this CPU has, in ISA_OPTIONS' order
    has_amx: bool

    @property
    def key(self) -> str:
        """Names the build folder: the widest levels the build uses, e.g. 'avx2-fma' or 'avx512-vnni-bf16-amxoff'."""
        parts = ["avx512" if "avx512f" in self.flags else "avx2" if "avx2" in self.flags else "sse"]
        parts += [name for flag, name in [("fma", "fma"), ("avx_vnni", "avxvnni"), ("avx512_vnni", "vnni"),
                                          ("avx512_bf16", "bf16"), ("avx512vbmi", "vbmi")] if flag in self.flags]
        return "-".join(parts + (["amxoff"] if self.has_amx else []))

    def cmake_options(self) -> list[str]:
        isa = [f"-D{option}={'ON' if flag in self.flags else 'OFF'}" for flag, option in ISA_OPTIONS.items()]
        return ["-DGGML_NATIVE=OFF", *isa, *(f"-D{option}=OFF" for option in AMX_OPTIONS)]

    def note(self) -> str:
        amx = "; AMX present but left out (llama.cpp's AMX path crashed here)" if self.has_amx else ""
        return f"GGML_NATIVE=OFF with {', '.join(self.flags)}{amx}"


def cpu_isa(cpuinfo: str | None = None) -> Isa:
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    return Isa([flag for flag in ISA_OPTIONS if flag in flags], any(f.startswith("amx") for f in flags))


def cache_root() -> Path:
    if root := os.environ.get("INFERNO_LLAMACPP_CACHE"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inferno" / "llama.cpp"


def build_dir(isa: Isa | None = None) -> Path:
    return cache_root() / f"{VERSION}-{(isa or cpu_isa()).key}"


def tool_paths(folder: Path) -> dict[str, Path] | None:
    """The tools of a finished build in `folder`, or None when it has not been built."""
    paths = {name: folder / "bin" / name for name in TOOLS}
    return paths if all(p.is_file() for p in paths.values()) else None


def build_info(folder: Path) -> dict:
    """What build.json recorded: the llama-cpp-python version whose llama.cpp it built, the CMake options, the ISA
    note, the seconds the (last session of the) build took."""
    path = folder / "build.json"
    return json.loads(path.read_text()) if path.exists() else {}


def run_logged(cmd: list[str], log: Path) -> None:
    print(f"$ {' '.join(cmd)}", flush=True)
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{cmd[0]} failed (exit {result.returncode}); the last lines of {log}:\n{tail}")


def fetch_sources(work: Path, log: Path, sdist: Path | None) -> Path:
    """llama.cpp's source tree out of the llama-cpp-python sdist (downloaded unless `sdist` is given); a tree
    left by an interrupted build is kept, and its build goes on where it stopped (ninja)."""
    source = work / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (work / ".extracted").exists():
        return source
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    if sdist is None:
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={VERSION}", "-d", str(work)], log)
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
    prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(work, members=members, filter="data")
    assert (source / "CMakeLists.txt").exists(), f"{sdist} holds no {source.relative_to(work)}"
    (work / ".extracted").touch()
    return source


def cmake_build(source: Path, isa: Isa, jobs: int, log: Path) -> list[str]:
    options = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TOOLS=ON",
               "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", *isa.cmake_options()]
    run_logged(["cmake", "-S", str(source), "-B", str(source / "build"), *options], log)
    for tool in TOOLS:  # one after another: the benchmark tools are ready first, the server needs the most
        run_logged(["cmake", "--build", str(source / "build"), "-j", str(jobs), "--target", tool], log)
    return options


def build(jobs: int = 2, sdist: Path | None = None) -> dict[str, Path]:
    """The tools' paths, built first if this machine has no build yet (once; concurrent callers wait for it)."""
    isa = cpu_isa()
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"build_llamacpp names x86 ISA flags; this machine is {platform.machine()}")
    folder = build_dir(isa)
    if paths := tool_paths(folder):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent builder finishes first; then the check below sees its work
        if paths := tool_paths(folder):
            return paths
        work, log = folder / "work", folder / "build.log"
        with log.open("a") as out:
            out.write(f"llama.cpp tools build, {isa.note()}\n")
        print(f"building llama.cpp's {', '.join(TOOLS)} in {folder} ({isa.note()}; log: {log}; ~10 min on 2 cores)",
              flush=True)
        start = time.monotonic()
        source = fetch_sources(work, log, sdist)
        options = cmake_build(source, isa, jobs, log)
        staging = work / "bin"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        for name in TOOLS:
            shutil.copy2(source / "build" / "bin" / name, staging / name)
        info = {"llama_cpp_python": VERSION, "isa": isa.note(),
                "cmake_options": options, "build_seconds": round(time.monotonic() - start)}
        (folder / "build.json").write_text(json.dumps(info, indent=1) + "\n")
        shutil.rmtree(folder / "bin", ignore_errors=True)
        staging.rename(folder / "bin")
        shutil.rmtree(work, ignore_errors=True)
        print(f"built in {info['build_seconds']} s", flush=True)
        return tool_paths(folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    p.add_argument("--sdist", type=Path, default=None, help="a llama-cpp-python sdist already downloaded")
    p.add_argument("--print-dir", action="store_true", help="print the build folder for this CPU and exit")
    args = p.parse_args()
    if args.print_dir:
        print(build_dir())
        return
    paths = build(args.jobs, args.sdist)
    print(paths["llama-bench"].parent)


if __name__ == "__main__":
    main()
