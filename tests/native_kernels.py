"""The native kernel tests' helpers. `needs_kernels`: they skip only where the kernels are switched off
(INFERNO_DISABLE_CPP_KERNELS=1); a kernel library that failed to build or load fails them instead.

`isa_level_run`: the installed kernel library of each ISA level, run in a fresh process capped at that level
(INFERNO_CPU_ISA; one library per process), so that each level's paths run on this CPU: the AVX-512 VNNI one, AVX2
with and without AVX-VNNI (the maddubs sums of most AVX2 CPUs) and the plain loops of `scalar`. A level this CPU
cannot run is skipped."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inferno.cpu_features import ISA_LEVELS, supported_isa_levels
from inferno.kernels import kernel_library
from inferno.kernels.library import kernels_disabled

ROOT = Path(__file__).resolve().parent.parent

needs_kernels = pytest.mark.skipif(kernels_disabled(), reason="INFERNO_DISABLE_CPP_KERNELS=1")


def require_kernels():
    """Inside a test that runs both paths: skips its native case only under INFERNO_DISABLE_CPP_KERNELS=1, and fails
    it where the kernel library did not load."""
    if kernels_disabled():
        pytest.skip("INFERNO_DISABLE_CPP_KERNELS=1")
    assert kernel_library() is not None, "the native kernels did not load: see the warning above"

# every ISA level, as a test parameter "level"
EACH_ISA_LEVEL = pytest.mark.parametrize("level", [level.name for level in ISA_LEVELS])

# argv: the level, a path holding the inputs (then the outputs), the code that computes `outputs` from `inputs`
SCRIPT = """
import sys, torch
from inferno.kernels import kernel_library
level, data, code = sys.argv[1:]
library = kernel_library()
assert library is not None and library.level == level, f"loaded {library} instead of the {level} library"
scope = {"torch": torch, "inputs": torch.load(data)}
exec(code, scope)
torch.save(scope["outputs"], data)
"""


def isa_level_run(tmp_path: Path, level: str, code: str, inputs):
    """`outputs` of `code` run on `inputs` (any torch.save-able value) with the kernel library of ISA level `level`;
    the code sees its operators in `torch.ops.inferno`."""
    if level not in {supported.name for supported in supported_isa_levels()}:
        pytest.skip(f"this CPU cannot run the {level} kernels")
    data = tmp_path / "data.pt"
    torch.save(inputs, data)
    env = {**os.environ, "INFERNO_CPU_ISA": level, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", SCRIPT, level, str(data), code], check=True, env=env)
    return torch.load(data)


def isa_level_outputs(tmp_path: Path, op: str, level: str, xs: list[torch.Tensor],
                      blocks: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A K-quant kernel (`{op}_gemv.cpp`): `{op}_matmul(x, blocks)` for each x and `{op}_dequantize(blocks,
    float32)` at `level`."""
    code = (f"xs, blocks = inputs\nops = torch.ops.inferno\n"
            f"outputs = ([ops.{op}_matmul(x, blocks) for x in xs], ops.{op}_dequantize(blocks, torch.float32))")
    return isa_level_run(tmp_path, level, code, (xs, blocks))


def isa_level_tiles_outputs(tmp_path: Path, op: str, level: str, xs: list[torch.Tensor],
                            blocks: torch.Tensor) -> list[torch.Tensor]:
    """A K-quant kernel's tiles (`{op}_gemv.cpp`): `{op}_tiles_matmul(x, {op}_tile(blocks))` for each x at
    `level`."""
    code = (f"xs, blocks = inputs\nops = torch.ops.inferno\n"
            f"outputs = [ops.{op}_tiles_matmul(x, ops.{op}_tile(blocks)) for x in xs]")
    return isa_level_run(tmp_path, level, code, (xs, blocks))


def isa_level_int4_tiles_outputs(tmp_path: Path, level: str, xs: list[torch.Tensor], packed: torch.Tensor, k: int,
                                 group_size: int, zero_points: bool) -> list[torch.Tensor]:
    """The int4 tiles (quantized_gemv.cpp): `int4_tiles_matmul(x, int4_tile(packed, ...))` for each x at `level`."""
    code = (f"xs, packed = inputs\nops = torch.ops.inferno\ntiles = ops.int4_tile(packed, {k}, {group_size})\n"
            f"outputs = [ops.int4_tiles_matmul(x, tiles, {zero_points}) for x in xs]")
    return isa_level_run(tmp_path, level, code, (xs, packed))


def isa_level_q8_tiles_outputs(tmp_path: Path, level: str, xs: list[torch.Tensor], codes: torch.Tensor,
                               scales: torch.Tensor, tiles: str = "q8") -> list[torch.Tensor]:
    """The Q8 tiles (quantized_gemv.cpp) or with `tiles="q5"` the Q5 tiles (q5_tiles.cpp):
    `{tiles}_tiles_matmul(x, {tiles}_tile(codes, scales))` for each x at `level`."""
    code = (f"xs, codes, scales = inputs\nops = torch.ops.inferno\ntiles = ops.{tiles}_tile(codes, scales)\n"
            f"outputs = [ops.{tiles}_tiles_matmul(x, tiles) for x in xs]")
    return isa_level_run(tmp_path, level, code, (xs, codes, scales))
