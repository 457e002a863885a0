"""The weights moved onto transparent huge pages while the engine serves.

A decode step reads every weight once; from 4 KiB pages that is a TLB miss every 4 KiB, from 2 MiB pages one per
2 MiB (Qwen2.5-Coder-1.5B Q4_K_M decodes about 4 % faster on this project's AMD machine, whose TLB
already merges runs of contiguous 4 KiB pages of the page cache's large folios). A GGUF file's blocks run
from its memory map (4 KiB page-cache pages), and a weight built at load (a repack, a fused projection's copy)
lands in ordinary heap pages. Copying them into huge pages before serving would delay the first token by the copy (and on a
virtual machine, whose fresh memory the host backs on first touch, by about 2 s per GiB), so the copy runs in the
model runner's background warm-up instead, and each 2 MiB-aligned range is swapped in place: the bytes are copied
into a new anonymous mapping advised for huge pages, which `mremap` then moves over the old range. The addresses
and the bytes stay the same: no tensor, kernel or compiled graph notices, and a step running meanwhile reads the
old pages or the new ones, never anything else (the kernel swaps the page tables under the mapping's lock).

Only bytes nothing writes may move: in a private map of a file (the GGUF file's, which holds nothing but the
file) every 2 MiB page with weight bytes in it, elsewhere only the 2 MiB pages that weights cover entirely (a heap
page shared with other objects could be written during the copy). Shared mappings never move (their pages are
someone else's too). Linux only; ranges already advised for huge pages are skipped, and nothing moves where the copy
would not fit in the memory available.
"""
import ctypes
import ctypes.util
import logging
import mmap
import sys
import time
from dataclasses import dataclass

import torch

from inferno.worker.kv_cache import available_memory

logger = logging.getLogger("inferno")

HUGE_PAGE = 2 << 20  # x86-64's (and a 4 KiB-page arm64 kernel's); read from the kernel where it says
MADV_HUGEPAGE = 14
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2
THP = "/sys/kernel/mm/transparent_hugepage"
CHUNK = 64 << 20  # bytes swapped at a time: the copy's extra memory at any moment


@dataclass(slots=True)
class Mapping:
    """One line of /proc/self/maps (with its smaps VmFlags)."""
    start: int
    end: int
    shared: bool  # MAP_SHARED (shared memory, a file written through): never moved
    file: bool  # maps a file (else anonymous memory)
    huge_advised: bool  # VmFlags "hg": faults there already take huge pages


def read_mappings() -> list[Mapping]:
    mappings, current = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=6)
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                start, end = (int(a, 16) for a in head[0].split("-"))
                current = Mapping(start, end, head[1].endswith("s"), head[4] != "0", False)  # inode 0: anonymous
                mappings.append(current)
            elif head[0] == "VmFlags:" and current is not None:
                current.huge_advised = "hg" in line.split()[1:]
    return mappings


def tensor_span(t: torch.Tensor) -> tuple[int, int]:
    """The [start, end) addresses of the bytes a tensor's elements lie in."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def weight_ranges(model: torch.nn.Module) -> list[tuple[int, int]]:
    """The [start, end) addresses of the model's parameters and buffers that its forward reads (not a module's
    `unread_buffers`: a weight regrouped into tiles), overlapping ones merged (never across a gap, however small:
    the allocator may have put other objects there)."""
    tensors = []
    for module in model.modules():
        unread = getattr(module, "unread_buffers", ())
        named = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        tensors += [t for name, t in named if name not in unread]
    spans = sorted({tensor_span(t) for t in tensors if t.device.type == "cpu" and t.numel()})
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def movable_ranges(weights: list[tuple[int, int]], mappings: list[Mapping],
                   page: int = HUGE_PAGE) -> list[tuple[int, int]]:
    """Huge-page-aligned ranges to swap (`page` bytes a page), in the private mappings holding weights and not yet
    advised for huge pages: in a map of a file, every huge page holding weight bytes (within the mapping); in
    anonymous memory the huge pages the weights cover entirely."""
    ranges: list[tuple[int, int]] = []
    for m in mappings:
        if m.huge_advised or m.shared:
            continue
        for s, e in weights:
            if s >= m.end or e <= m.start:
                continue
            if m.file:
                s, e = s // page * page, -(-e // page) * page
            s, e = max(s, m.start), min(e, m.end)
            s, e = -(-s // page) * page, e // page * page
            if s >= e:
                continue
            if ranges and s <= ranges[-1][1]:
                ranges[-1] = (ranges[-1][0], max(ranges[-1][1], e))
            else:
                ranges.append((s, e))
    return ranges


def huge_page_size() -> int:
    """Bytes in a transparent huge page here (2 MiB on x86-64, 512 MiB on a 64 KiB-page arm64 kernel); 0 where
    transparent huge pages are off or unknown."""
    try:
        with open(f"{THP}/enabled") as f:
            if "[never]" in f.read():
                return 0
        with open(f"{THP}/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


class Libc:
    def __init__(self):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype, self.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                                  ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.munmap = libc.munmap
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.madvise = libc.madvise
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.mremap = libc.mremap
        self.mremap.restype, self.mremap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t,
                                                                      ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

    def aligned_huge_region(self, size: int, page: int) -> int:
        """A new private anonymous mapping of `size` bytes at a `page`-aligned address, advised for huge pages."""
        raw = self.mmap(None, size + page, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if raw in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        start = -(-raw // page) * page
        if start > raw:
            self.munmap(raw, start - raw)
        if raw + page > start:
            self.munmap(start + size, raw + page - start)
        if self.madvise(start, size, MADV_HUGEPAGE) != 0:
            self.munmap(start, size)
            raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")
        return start

    def swap_in_huge_pages(self, start: int, size: int, page: int) -> None:
        """Copy [start, start + size) into huge pages and move them over the old range."""
        region = self.aligned_huge_region(size, page)
        ctypes.memmove(region, start, size)
        if self.mremap(region, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, start) != start:
            errno = ctypes.get_errno()
            self.munmap(region, size)
            raise OSError(errno, "mremap failed")


def move_weights_to_huge_pages(model: torch.nn.Module) -> int:
    """Swap the model's weights onto transparent huge pages in place (see the module's notes); the bytes moved."""
    page = huge_page_size() if sys.platform == "linux" else 0
    if page == 0:
        return 0
    start_time = time.perf_counter()
    ranges = movable_ranges(weight_ranges(model), read_mappings(), page)
    total = sum(e - s for s, e in ranges)
    if total == 0:
        return 0
    if total > available_memory() // 2:
        logger.info("weights stay on small pages: moving %.2f GiB onto huge pages would take over half the memory "
                    "available", total / 2**30)
        return 0
    libc = Libc()
    moved = 0
    try:
        for start, end in ranges:
            for at in range(start, end, max(CHUNK, page)):
                size = min(max(CHUNK, page), end - at)
                libc.swap_in_huge_pages(at, size, page)
                moved += size
    except OSError as e:
        logger.warning("moving the weights onto huge pages stopped after %.2f GiB: %s", moved / 2**30, e)
        return moved
    logger.info("weights moved onto huge pages: %.2f GiB in %.1f s", moved / 2**30, time.perf_counter() - start_time)
    return moved
