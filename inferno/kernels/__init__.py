"""Native CPU kernels, compiled on first use with torch.utils.cpp_extension (cached under
~/.cache/torch_extensions) and registered as `torch.ops.inferno.*` operators. Without a compiler, or with
INFERNO_DISABLE_CPP_KERNELS=1, the plain PyTorch paths are used instead."""
import functools
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger("inferno")


@functools.cache
def paged_attention():
    """The `torch.ops.inferno` namespace holding `paged_decode_attention`, or None when it cannot be built."""
    if os.environ.get("INFERNO_DISABLE_CPP_KERNELS") == "1":
        return None
    from torch.utils import cpp_extension
    try:
        cpp_extension.load(
            name="inferno_paged_attention_op", sources=[str(Path(__file__).with_name("paged_attention.cpp"))],
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False,
            verbose=False)
    except Exception as e:  # no compiler / ninja / headers: keep serving on the PyTorch path
        logger.warning("native paged attention kernel unavailable (%s: %s); using the PyTorch path",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None

    @torch.library.register_fake("inferno::paged_decode_attention")
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale):  # shapes for torch.compile's tracing
        return torch.empty_like(q)

    return torch.ops.inferno
