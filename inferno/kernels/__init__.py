"""Native CPU kernels, compiled on first use with torch.utils.cpp_extension (cached under
~/.cache/torch_extensions). Without a compiler, or with INFERNO_DISABLE_CPP_KERNELS=1, the plain PyTorch
paths are used instead."""
import functools
import logging
import os
from pathlib import Path
from types import ModuleType

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
