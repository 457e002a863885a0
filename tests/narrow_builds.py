"""A K-quant kernel file (`{op}_gemv.cpp`) built on this CPU without the instructions of its wider paths
(`-mno-avx512f`, `-mno-avx2`, ...), so that the AVX2 path and the plain loops run here too. The build loads in a
fresh process (the operators of one build per process); the first build takes about half a minute, later runs reuse
it."""
import subprocess
import sys
from pathlib import Path

import torch

import inferno.kernels
from inferno.cpu_features import cpu_key

# argv: extension name, source, flags, operator prefix, a path holding the inputs (then the results)
SCRIPT = """
import sys, torch
from torch.utils import cpp_extension
name, source, flags, op, data = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4], sys.argv[5]
cpp_extension.load(name=name, sources=[source], extra_cflags=["-O3", "-march=native", *flags, "-fopenmp"],
                   extra_ldflags=["-fopenmp"], is_python_module=False)
xs, blocks = torch.load(data)
ys = [getattr(torch.ops.inferno, f"{op}_matmul")(x, blocks) for x in xs]
torch.save((ys, getattr(torch.ops.inferno, f"{op}_dequantize")(blocks, torch.float32)), data)
"""


def narrow_build_outputs(tmp_path: Path, op: str, flags: str, xs: list[torch.Tensor],
                         blocks: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`{op}_matmul(x, blocks)` for each x and `{op}_dequantize(blocks, float32)` from the build with `flags`."""
    data = tmp_path / "data.pt"
    torch.save((xs, blocks), data)
    name = f"inferno_{op}_gemv_{flags.replace('-mno-', '_no_').replace(' ', '')}_{cpu_key()}"
    source = Path(inferno.kernels.__file__).with_name(f"{op}_gemv.cpp")
    subprocess.run([sys.executable, "-c", SCRIPT, name, str(source), flags, op, str(data)], check=True)
    return torch.load(data)
