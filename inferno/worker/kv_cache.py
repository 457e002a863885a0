"""The KV cache pool's size when the user gives none, and its memory.

By default the pool takes a share of the memory still available once the weights are loaded (never more than
`max_num_seqs` sequences of `max_model_len` tokens). Its pages come from an anonymous mapping, which the OS fills
with zeros on first touch: start-up does not write gigabytes of zeros, and pages no request ever reaches cost no
memory at all.
"""
import logging
import math
import mmap
import os

import torch

logger = logging.getLogger("inferno")

# Share of MemAvailable (after the weights are loaded) the default pool may take. The rest is headroom for the step's
# activations, the compiled decode step, the tokenizer, the server and whatever else runs on the machine: a pool that
# fills up over hours of serving (the prefix cache keeps freed blocks) must never get the process OOM-killed.
AUTO_KV_CACHE_FRACTION = 0.5


# (limit, usage) files of a container's memory cgroup: v2, then v1 (whose "no limit" is a huge number)
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def total_memory() -> int:
    """Bytes of RAM: what no start-up changes (available_memory is never more)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory() -> int:
    """Bytes this process can still allocate without swapping: the kernel's MemAvailable (the total RAM where that
    is unknown), or less where a container's memory limit is closer."""
    available = total_memory()
    try:
        with open("/proc/meminfo") as meminfo:
            kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
            available = kib * 1024
    except (OSError, StopIteration):
        pass
    for limit_file, usage_file in CGROUP_FILES:
        try:
            with open(limit_file) as limit, open(usage_file) as usage:
                limit_text, used = limit.read().strip(), int(usage.read())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit():
            available = min(available, max(int(limit_text) - used, 0))
        break
    return available


def auto_num_blocks(block_bytes: int, max_useful_blocks: int) -> int:
    """Blocks in a pool sized for this machine: AUTO_KV_CACHE_FRACTION of the available memory, at most
    `max_useful_blocks`."""
    return min(int(available_memory() * AUTO_KV_CACHE_FRACTION) // block_bytes, max_useful_blocks)


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on pages of its own that the OS zero-fills when first touched (an anonymous mmap, page
    aligned; the tensor keeps the mapping alive)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(pages, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)
