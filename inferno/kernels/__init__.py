"""Native CPU kernels, compiled on first use with torch.utils.cpp_extension (cached under
~/.cache/torch_extensions). Without a compiler, or with INFERNO_DISABLE_CPP_KERNELS=1, the plain PyTorch
paths are used instead."""
import functools
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("inferno")


@functools.cache
def paged_attention() -> ModuleType | None:
    if os.environ.get("INFERNO_DISABLE_CPP_KERNELS") == "1":
        return None
    from torch.utils import cpp_extension
    try:
        return cpp_extension.load(
            name="inferno_paged_attention", sources=[str(Path(__file__).with_name("paged_attention.cpp"))],
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler / ninja / headers: keep serving on the PyTorch path
        logger.warning("native paged attention kernel unavailable (%s: %s); using the PyTorch path",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


@functools.cache
def int8_gemv():
    """The `torch.ops.inferno` namespace holding `int8_group_matmul` (float32 rows times group-wise int8 weights)
    and `int8_group_dequantize` (see int8_gemv.cpp), or None when they cannot be built."""
    if os.environ.get("INFERNO_DISABLE_CPP_KERNELS") == "1":
        return None
    from torch.utils import cpp_extension
    try:
        cpp_extension.load(
            name="inferno_int8_gemv", sources=[str(Path(__file__).with_name("int8_gemv.cpp"))],
            extra_cflags=["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"], extra_ldflags=["-fopenmp"],
            is_python_module=False, verbose=False)
    except Exception as e:  # no compiler / ninja / headers: the layers dequantize and use F.linear
        logger.warning("native int8 matmul kernel unavailable (%s: %s); using dequantize + F.linear",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None

    @torch.library.register_fake("inferno::int8_group_matmul")
    def _(x, codes, scales, mins, group_size):  # shapes for torch.compile's tracing
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("inferno::int8_group_dequantize")
    def _(codes, scales, mins, group_size):
        return scales.new_empty(codes.shape)

    return torch.ops.inferno
