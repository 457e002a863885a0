"""Builds inferno's native CPU kernels at install time (pyproject.toml holds everything else): one library per ISA
level of inferno/cpu_features.py (`inferno/kernels/_kernels_<level>*.so`), all of the kernel files in each, of which
a process loads the best its CPU runs. A failed build fails the install. INFERNO_BUILD_ISA=avx2,scalar builds only
those levels (a quicker build for development; the levels left out then run on a lower level)."""
import os
import runpy
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).parent
cpu_features = runpy.run_path(str(ROOT / "inferno" / "cpu_features.py"))
KERNELS = ROOT / "inferno" / "kernels"
SOURCES = sorted(str(path.relative_to(ROOT)) for path in KERNELS.glob("*.cpp"))
HEADERS = sorted(str(path.relative_to(ROOT)) for path in KERNELS.glob("*.h"))  # an edited header rebuilds too


def levels_to_build() -> list:
    levels = cpu_features["built_isa_levels"]()
    if names := os.environ.get("INFERNO_BUILD_ISA"):
        wanted = set(names.split(","))
        levels = [level for level in levels if level.name in wanted]
        assert levels, f"INFERNO_BUILD_ISA names none of {[level.name for level in cpu_features['ISA_LEVELS']]}"
    return levels


def kernel_library(level) -> CppExtension:
    return CppExtension(f"inferno.kernels._kernels_{level.name}", SOURCES, depends=HEADERS,
                        extra_compile_args=["-O3", "-g0", *level.cflags, "-fopenmp"], extra_link_args=["-fopenmp"])


class BuildKernels(BuildExtension):
    """Each level's objects in a folder of their own (the sources are the same): a rebuild compiles what changed."""

    def build_extension(self, ext):
        build_temp = self.build_temp
        self.build_temp = os.path.join(build_temp, ext.name.rpartition(".")[2])
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = build_temp


setup(ext_modules=[kernel_library(level) for level in levels_to_build()], cmdclass={"build_ext": BuildKernels})
