"""The OpenMP thread pools behind PyTorch's CPU ops, when more than one thread runs ops.

libgomp keeps a pool of worker threads for every thread that has run a parallel region, for the life of that
thread. Once it manages more threads than there are CPUs, it cuts its workers' spin-wait to 100 iterations
(`gomp_throttled_spin_count`), so every parallel region pays futex wake-ups. A server loads the model on the
main thread and steps it on the engine thread, so the main thread's idle worker alone throttles every parallel
region of a decode step (visible in benchmarks/serve.py's inter-token latency). Hence: the thread that steps the
engine is the only one that keeps a pool; the thread that loaded the model releases its own (`LLMEngine`); helper
threads beside the engine (the KV connector's) run their ops on themselves.
"""
import ctypes
import functools

import torch


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """PyTorch's OpenMP runtime (its symbols are global in this process), or None where it has none."""
    if not torch.backends.openmp.is_available():
        return None
    runtime = ctypes.CDLL(None)
    return runtime if hasattr(runtime, "omp_pause_resource_all") else None


OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the threads, not only idle them


def release_thread_pool() -> None:
    """Hand back the calling thread's OpenMP workers (the next parallel region it runs would start new ones)."""
    runtime = _runtime()
    if runtime is not None:
        runtime.omp_pause_resource_all(OMP_PAUSE_HARD)


def run_ops_on_this_thread() -> None:
    """From now on this thread's ops run on it alone, without a pool of its own; other threads keep theirs."""
    use_threads_on_this_thread(1)


def use_threads_on_this_thread(threads: int) -> None:
    """From now on this thread's ops run on `threads` threads; other threads keep their count. (`torch.set_num_threads`
    would change every thread's count, and MKL's.)"""
    runtime = _runtime()
    # PyTorch sets a thread's OpenMP count on its first use (get_num_threads does it first)
    if runtime is not None and torch.get_num_threads() != threads:
        runtime.omp_set_num_threads(threads)
