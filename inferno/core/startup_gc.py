"""The cyclic garbage collector held off while inferno starts.

Importing torch and inferno and building an engine allocate millions of container objects (modules, operator
tables, a vocabulary's merges) that nearly all live on; the collector, triggered by allocation counts, scans them
over and over (several full collections and hundreds of young ones: a visible share of the time to the first
token, benchmarks/startup.py). None of it is cyclic garbage worth collecting then; collection resumes
afterwards. What the imports built (modules, classes, functions: they live as long as the process) is frozen out of
later collections' scans (`gc.freeze`, as pre-fork servers do), and so is what the engine built where the process
is inferno's own (`inferno generate`, `chat`, `serve`); an engine built through the Python API is not frozen (the
program may drop it, and a frozen cycle would never be collected).
"""
import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused(freeze: bool = False) -> Iterator[None]:
    """No cyclic collection inside the block (reference counting still frees everything else); `freeze`: what
    exists when the block ends is left out of every later collection (`gc.freeze`)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        if freeze:
            gc.freeze()
    finally:
        if was_enabled:
            gc.enable()
