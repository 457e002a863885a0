"""A kernel file built on this CPU without the instructions of its wider paths (`-mno-avx512f`, `-mno-avx2`, ...),
so that the AVX2 path and the plain loops run here too. The build loads in a fresh process (the operators of one
build per process); the first build takes about half a minute, later runs reuse it."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import inferno.kernels
from inferno.cpu_features import cpu_key

# the kernel files' AVX2 (with and without AVX-VNNI) and plain paths, as a test parameter "flags"
NARROW_BUILDS = pytest.mark.parametrize(
    "flags", ["-mno-avx512f", "-mno-avx512f -mno-avxvnni", "-mno-avx512f -mno-avx2"],
    ids=["avx2", "avx2-without-vnni", "plain"])

# argv: extension name, sources (comma-separated), flags, a path holding the inputs (then the outputs), the code
# that computes `outputs` from `inputs` with the build's operators
SCRIPT = """
import sys, torch
from torch.utils import cpp_extension
name, sources, flags, data, code = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(), sys.argv[4], sys.argv[5]
cpp_extension.load(name=name, sources=sources, extra_cflags=["-O3", "-march=native", *flags, "-fopenmp"],
                   extra_ldflags=["-fopenmp"], is_python_module=False)
scope = {"torch": torch, "inputs": torch.load(data)}
exec(code, scope)
torch.save(scope["outputs"], data)
"""


def narrow_build_run(tmp_path: Path, sources: list[str], flags: str, code: str, inputs):
    """`outputs` of `code` run on `inputs` (any torch.save-able value) with the kernels of `sources` built with
    `flags`; the code sees the build's operators in `torch.ops.inferno`."""
    data = tmp_path / "data.pt"
    torch.save(inputs, data)
    name = f"inferno_{Path(sources[0]).stem}_{flags.replace('-mno-', '_no_').replace(' ', '')}_{cpu_key()}"
    paths = [str(Path(inferno.kernels.__file__).with_name(source)) for source in sources]
    subprocess.run([sys.executable, "-c", SCRIPT, name, ",".join(paths), flags, str(data), code], check=True)
    return torch.load(data)


def narrow_build_outputs(tmp_path: Path, op: str, flags: str, xs: list[torch.Tensor],
                         blocks: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A K-quant kernel (`{op}_gemv.cpp`): `{op}_matmul(x, blocks)` for each x and `{op}_dequantize(blocks,
    float32)` from the build with `flags`."""
    code = (f"xs, blocks = inputs\nops = torch.ops.inferno\n"
            f"outputs = ([ops.{op}_matmul(x, blocks) for x in xs], ops.{op}_dequantize(blocks, torch.float32))")
    return narrow_build_run(tmp_path, [f"{op}_gemv.cpp"], flags, code, (xs, blocks))


def narrow_build_tiles_outputs(tmp_path: Path, op: str, flags: str, xs: list[torch.Tensor],
                               blocks: torch.Tensor) -> list[torch.Tensor]:
    """A K-quant kernel's tiles (`{op}_gemv.cpp`): `{op}_tiles_matmul(x, {op}_tile(blocks))` for each x from the
    build with `flags`."""
    code = (f"xs, blocks = inputs\nops = torch.ops.inferno\n"
            f"outputs = [ops.{op}_tiles_matmul(x, ops.{op}_tile(blocks)) for x in xs]")
    return narrow_build_run(tmp_path, [f"{op}_gemv.cpp"], flags, code, (xs, blocks))


def narrow_build_int4_tiles_outputs(tmp_path: Path, flags: str, xs: list[torch.Tensor], packed: torch.Tensor, k: int,
                                    group_size: int, zero_points: bool) -> list[torch.Tensor]:
    """The int4 tiles (quantized_gemv.cpp): `int4_tiles_matmul(x, int4_tile(packed, ...))` for each x from the build
    with `flags`."""
    code = (f"xs, packed = inputs\nops = torch.ops.inferno\ntiles = ops.int4_tile(packed, {k}, {group_size})\n"
            f"outputs = [ops.int4_tiles_matmul(x, tiles, {zero_points}) for x in xs]")
    return narrow_build_run(tmp_path, ["quantized_gemv.cpp"], flags, code, (xs, packed))


def narrow_build_q8_tiles_outputs(tmp_path: Path, flags: str, xs: list[torch.Tensor], codes: torch.Tensor,
                                  scales: torch.Tensor) -> list[torch.Tensor]:
    """The Q8 tiles (quantized_gemv.cpp): `q8_tiles_matmul(x, q8_tile(codes, scales))` for each x from the build with
    `flags`."""
    code = ("xs, codes, scales = inputs\nops = torch.ops.inferno\ntiles = ops.q8_tile(codes, scales)\n"
            "outputs = [ops.q8_tiles_matmul(x, tiles) for x in xs]")
    return narrow_build_run(tmp_path, ["quantized_gemv.cpp"], flags, code, (xs, codes, scales))
