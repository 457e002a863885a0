"""glibc malloc tuning for the CPU path.

Each step allocates large temporaries (activations, gathered K/V) of similar sizes. By default glibc serves
them with fresh mmaps and returns them on free, so every step pays a page fault per 4 KiB touched. Keeping
large blocks on the heap and not trimming it lets the next step reuse warm pages.
"""
import ctypes
import ctypes.util
import logging

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

logger = logging.getLogger("inferno")


def keep_freed_memory() -> None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to tune
        return
    if not ok:
        logger.debug("mallopt refused the malloc tuning")
