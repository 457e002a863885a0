"""Builds inferno's native CPU kernels at install time (pyproject.toml holds everything else): one library per ISA
level of inferno/cpu_features.py (`inferno/kernels/_kernels_<level>*.so`), of which a process loads the best its CPU
runs. ops.cpp, everything torch-facing, compiles once and is linked into every library; the kernel bodies (the other
*.cpp files: plain C++, no PyTorch header) compile once per level, with that level's flags; all of them at once, the
levels side by side. A failed build fails the install. INFERNO_BUILD_ISA=avx2,scalar builds only those levels (a
quicker build for development; the levels left out then run on a lower level)."""
import os
import re
import runpy
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).parent
cpu_features = runpy.run_path(str(ROOT / "inferno" / "cpu_features.py"))
KERNELS = ROOT / "inferno" / "kernels"
SOURCES = sorted(str(path.relative_to(ROOT)) for path in KERNELS.glob("*.cpp"))
OPS = str((KERNELS / "ops.cpp").relative_to(ROOT))  # torch-facing: schemas, checks, outputs, threads
BODIES = [source for source in SOURCES if source != OPS]
HEADERS = sorted(str(path.relative_to(ROOT)) for path in KERNELS.glob("*.h"))  # an edited header rebuilds too
BASELINE = cpu_features["ISA_LEVELS"][-1]  # ops.cpp runs on every CPU: built for the lowest level
OPS_FLAGS = ["-O2", "-g0", *BASELINE.cflags, "-fopenmp"]  # no arithmetic there: -O3 would only take longer
# avx2_vnni is avx2 plus AVX-VNNI, which only code under __AVXVNNI__ uses (the other bodies' loops are float math and
# byte moves, compiled the same with it): it compiles the bodies that name the macro and links avx2's objects of the rest
BORROWS = {"avx2_vnni": ("avx2", "__AVXVNNI__")}


def names_macro(source: Path, macro: str) -> bool:
    """`source`, or a header of this folder it includes, names `macro` outside comments."""
    text = source.read_text()
    return macro in re.sub(r"//.*", "", text) or any(
        names_macro(KERNELS / header, macro) for header in re.findall(r'#include "(\w+\.h)"', text))


def levels_to_build() -> list:
    levels = cpu_features["built_isa_levels"]()
    if names := os.environ.get("INFERNO_BUILD_ISA"):
        wanted = set(names.split(","))
        levels = [level for level in levels if level.name in wanted]
        assert levels, f"INFERNO_BUILD_ISA names none of {[level.name for level in cpu_features['ISA_LEVELS']]}"
    return levels


def kernel_library(level) -> CppExtension:
    return CppExtension(f"inferno.kernels._kernels_{level.name}", [*BODIES, OPS], depends=HEADERS,
                        extra_compile_args=["-O3", "-g0", *level.cflags, "-fopenmp"], extra_link_args=["-fopenmp"])


class BuildKernels(BuildExtension):
    """Every object first, in one go: ops.cpp's once and each level's bodies, each set in a folder of its own and
    compiled by a ninja run of its own, all the runs side by side (the cores share their jobs); then each level's
    library is linked from its bodies and ops.cpp's object. A rebuild compiles only what changed."""

    def build_extensions(self):
        self.objects = {}
        super().build_extensions()  # adds torch's flags to every extension and puts its ninja compile in place

    def build_extension(self, ext):
        if not self.objects:
            self.objects = self.compile_all()
        compile_sources = self.compiler.compile
        self.compiler.compile = lambda sources, **kwargs: list(self.objects[ext.name])
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = compile_sources

    def compile_all(self) -> dict[str, list[str]]:
        include_dirs = self.extensions[0].include_dirs
        level_of = {ext.name.rpartition("_kernels_")[2]: ext for ext in self.extensions}
        borrowed = {name: [source for source in BODIES if not names_macro(ROOT / source, macro)]
                    for name, (lender, macro) in BORROWS.items() if name in level_of and lender in level_of}
        sets = {"ops": ([OPS], OPS_FLAGS)} | {
            ext.name: ([source for source in BODIES if source not in borrowed.get(name, ())], ext.extra_compile_args)
            for name, ext in level_of.items()}
        jobs = os.environ.get("MAX_JOBS", "")
        total = int(jobs) if jobs.isdigit() else os.cpu_count() or 1
        os.environ["MAX_JOBS"] = str(max(1, total // len(sets)))  # per ninja run

        def compile_set(name: str) -> list[str]:
            sources, flags = sets[name]
            return self.compiler.compile(sources, output_dir=os.path.join(self.build_temp, name.rpartition(".")[2]),
                                         include_dirs=include_dirs, debug=self.debug, extra_postargs=flags,
                                         depends=HEADERS)
        try:
            with ThreadPoolExecutor(len(sets)) as pool:
                objects = {name: dict(zip(sets[name][0], objs)) for name, objs in zip(sets, pool.map(compile_set, sets))}
        finally:
            os.environ["MAX_JOBS"] = jobs
            if not jobs:
                del os.environ["MAX_JOBS"]
        for name, sources in borrowed.items():
            lender = objects[level_of[BORROWS[name][0]].name]
            objects[level_of[name].name] |= {source: lender[source] for source in sources}
        return {ext.name: [*objects[ext.name].values(), *objects["ops"].values()] for ext in self.extensions}


setup(ext_modules=[kernel_library(level) for level in levels_to_build()], cmdclass={"build_ext": BuildKernels})
