"""A runner's background warm-up, which brings it to its steady-state speed without holding up the first token: the
decode step compiled (CPU; on the tiles the runner made when it was built, worker/tiles.py), then the weights moved
onto huge pages (CPU); docs/warm-up.md.

Its life cycle: the ModelRunner makes it and `start`s it; `wait` blocks until it is over (`LLM.wait_for_warm_up`);
`stop` ends it where it is, which the interpreter's exit does for every one still running (`stop_warm_ups`)."""
import atexit
import ctypes
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from inferno.worker.compile_cache import (clear_compile_cache, code_digest, compile_cache_hits, precompiled_key,
                                         precompiled_path, read_precompiled, structure, use_compile_cache,
                                         write_precompiled)
from inferno.worker.compiled_decode import (CompiledDecode, compile_graphs, compile_options, import_compiler,
                                           load_graphs, warm_up_graphs)
from inferno.worker.huge_pages import move_weights_to_huge_pages

logger = logging.getLogger("inferno")

# the warm-up thread's niceness while it copies the weights to huge pages (not while it compiles: see step_threads)
WARM_UP_NICENESS = 10
# seconds the warm-up waits for the first step to be over (the first token of `inferno generate`: tracing holds the
# GIL, and the copy to huge pages takes memory bandwidth), then starts anyway
WARM_UP_DELAY = 1.0
# seconds the serving thread may wait for the GIL while the warm-up compiles (Python's default is 5 ms)
WARM_UP_SWITCH_INTERVAL = 0.0002
# seconds the interpreter's exit waits for a warm-up thread to stop (see stop_warm_ups)
WARM_UP_STOP_WAIT = 10.0
# held by the warm-up that loads or compiles its decode step: one at a time in a process (a draft model's runner has
# a warm-up of its own). FX's patches of torch.nn.Module are process-wide (`fx_patches_on_this_thread_only`): a
# second warm-up tracing meanwhile ran into the first one's ("_thread.get_ident" untraceable) and left its runner eager
COMPILING = threading.Lock()


class WarmUp:
    """One runner's warm-up thread. `compile_decode`: compile the decode step (warmed up on `scratch_block`, a block
    beyond the pool no request holds) and hand it to the runner with `hand_over`, which its next decode step uses;
    `huge_pages`: move the weights afterwards.

    While it compiles the decode step (not while it loads a precompiled one: seconds), steps run on one thread fewer
    (`step_threads`, which the runner applies to the serving thread before each step), and the compile runs at the
    serving thread's priority: it has a core of its own. Niced beside a serving thread busy on every core (whose
    OpenMP threads spin between operators), a compile never finished under steady load, and held the GIL the serving
    thread waited for."""

    def __init__(self, model: torch.nn.Module, attention, tiled_names: list[str], compile_decode: bool,
                 huge_pages: bool, scratch_block: int | None, block_size: int,
                 hand_over: Callable[[CompiledDecode], None]):
        self.model, self.attention, self.tiled_names = model, attention, tiled_names
        self.compile_decode, self.huge_pages = compile_decode, huge_pages
        self.scratch_block, self.block_size = scratch_block, block_size
        self.hand_over = hand_over
        self.compiled = False  # whether decode steps were handed a compiled step
        self.threads = torch.get_num_threads()  # the engine's
        self.step_threads = self.threads  # what steps run on now
        self._thread = threading.Thread(target=self._run, name="inferno-warm-up", daemon=True)
        self._first_step_done = threading.Event()

    def start(self) -> None:
        """Before the first step: the precompiled key's parts that describe the model are taken now, as a step
        leaves them (a step can leave state on the modules or the attention backend, and a key taken after one
        missed a step taken before it)."""
        if self.compile_decode:
            self._structure = structure(self.model), structure(self.attention)
        RUNNING.add(self)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the warm-up is over (at most `timeout` seconds); True if decode steps now run compiled."""
        self._thread.join(timeout)
        return self.compiled

    def step_done(self) -> None:
        """The runner's word that a step is over (the first one lets the warm-up's heavy work start)."""
        if not self._first_step_done.is_set():  # once: Event.set takes a lock
            self._first_step_done.set()

    def stop(self) -> None:
        """End the thread where it is, for the interpreter's exit (`stop_thread`)."""
        stop_thread(self._thread)

    def _run(self) -> None:
        """The copy to huge pages at a lower OS priority (Linux); the decode step on a core of its own."""
        try:
            if self.compile_decode:
                self._compile_decode_step()  # which waits for the first step once its graphs are loaded
            else:
                self._first_step_done.wait(WARM_UP_DELAY)
            lower_thread_priority()
            if self.huge_pages:
                try:
                    move_weights_to_huge_pages(self.model)
                except Exception:  # an optimisation: serving goes on from the pages the weights are on
                    logger.exception("moving the weights onto huge pages failed; they stay where they are")
        except WarmUpStopped:  # the interpreter is exiting
            pass

    def _compile_decode_step(self) -> None:
        """The decode graphs (worker/compiled_decode.py) loaded from the compile cache, else compiled and saved there,
        then run once on the scratch block and handed over.

        Compiling here while the serving thread runs eager forwards of the same modules is safe: dynamo's frame
        hook, fake-tensor and dispatch modes, grad/inference mode are all per thread, and tracing only reads the
        modules (their tiles are final by then). The warm-up calls do run the graphs on the real caches, but write
        only the scratch block.

        Tracing and code generation hold the GIL, which the serving thread gives up in every op call and then waits
        for, up to a switch interval each time (the convoy effect): at the default 5 ms a SmolLM2 decode step's few
        hundred calls took seconds, so the interval is short meanwhile."""
        folder = use_compile_cache()
        start = time.perf_counter()
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(WARM_UP_SWITCH_INTERVAL)
        try:
            with torch.inference_mode(), COMPILING:
                compiled = self._load_or_compile(folder)
        except Exception:
            logger.exception("compiling the decode step failed; decode steps stay eager")
            return
        finally:
            sys.setswitchinterval(switch_interval)
            self.step_threads = self.threads
        self.hand_over(compiled)
        self.compiled = True
        logger.info("decode steps run compiled from now on (warmed up in %.1f s; compile cache %s)",
                    time.perf_counter() - start, folder)

    def _load_or_compile(self, folder: Path) -> CompiledDecode:
        """The precompiled step of this model and configuration if the compile cache has a sound one, else the step
        compiled (once more from scratch where an entry of inductor's caches broke it) and saved.

        The precompiled graphs are looked up and loaded at once, while the first step runs; their first calls (and
        a compile's trace) wait for it to end (or WARM_UP_DELAY)."""
        start = time.perf_counter()
        if COMPILER_IMPORT is not None:
            COMPILER_IMPORT.join()
        options = compile_options()  # inductor's import and ISA probe, unless `import_compiler_early` ran them
        options_made = time.perf_counter()
        path = self._precompiled_path(folder, options)
        logger.info("decode step: looking for its precompiled graphs (inductor loaded in %.2f s, key made in %.2f s)",
                    options_made - start, time.perf_counter() - options_made)
        loaded = self._load_graphs(path, folder)
        self._first_step_done.wait(WARM_UP_DELAY)
        if loaded is not None:
            try:
                return self._warm_up_loaded(loaded, path)
            except Exception:
                self._drop_precompiled(path, folder)
        self.step_threads = max(1, self.threads - 1)  # until _compile_decode_step is over
        hits = compile_cache_hits()
        try:
            compiled = self._compile_and_warm_up()
        except Exception:
            if compile_cache_hits() == hits:
                raise
            logger.exception("a compiled decode graph from the compile cache failed; compiling afresh")
            clear_compile_cache(folder)
            compiled = self._compile_and_warm_up()
        write_precompiled(path, compiled.serialized)
        return compiled

    def _precompiled_path(self, folder: Path, options: dict) -> Path:
        """Keyed by what the trace reads: the model and its attention backend (the engine's options as they hold
        them: the KV caches' dtype and capacity, the backend, the quantized layers), the layers that run on tiles
        and inductor's options."""
        model, attention = self._structure
        return precompiled_path(folder, precompiled_key(model, attention, options, self.tiled_names))

    def _compile_and_warm_up(self) -> CompiledDecode:
        scratch = (self.model, self.attention, self.scratch_block, self.block_size)
        compiled = compile_graphs(*scratch)
        warm_up_graphs(compiled, *scratch)
        return compiled

    def _load_graphs(self, path: Path, folder: Path) -> CompiledDecode | None:
        """The graphs precompiled in `path`, unless there are none or they cannot be used (then removed)."""
        if (serialized := read_precompiled(path)) is None:
            return None
        start = time.perf_counter()
        try:
            compiled = load_graphs(serialized)
        except Exception:
            self._drop_precompiled(path, folder)
            return None
        logger.info("decode graphs loaded from %s in %.1f s (no tracing)", path.name, time.perf_counter() - start)
        return compiled

    def _warm_up_loaded(self, compiled: CompiledDecode, path: Path) -> CompiledDecode:
        start = time.perf_counter()
        warm_up_graphs(compiled, self.model, self.attention, self.scratch_block, self.block_size)
        logger.info("precompiled decode graphs of %s: first calls %.1f s", path.name, time.perf_counter() - start)
        return compiled

    @staticmethod
    def _drop_precompiled(path: Path, folder: Path) -> None:
        logger.exception("the precompiled decode step %s cannot be used; compiling afresh", path)
        path.unlink(missing_ok=True)
        clear_compile_cache(folder)  # its libraries may be what broke


class WarmUpStopped(BaseException):
    """Raised in a warm-up thread at the interpreter's exit (a BaseException: no `except Exception` swallows it)."""


# the thread importing inductor while the model loads (`import_compiler_early`), which a warm-up waits for
COMPILER_IMPORT: threading.Thread | None = None


def import_compiler_early() -> None:
    """Start importing inductor (and running its ISA probe, and hashing inferno's code for the precompiled key) on a
    thread of its own, at the normal priority, once per process: called before the model loads, while a core is
    mostly idle. Done by the niced warm-up thread beside a busy serving thread it took 20-70 s (SmolLM2, 2 cores),
    most of a second start's wait for its compiled step."""
    global COMPILER_IMPORT
    if COMPILER_IMPORT is None:
        COMPILER_IMPORT = threading.Thread(target=import_compiler_quietly, name="inferno-import-compiler",
                                           daemon=True)
        COMPILER_IMPORT.start()


def import_compiler_quietly() -> None:
    try:
        use_compile_cache()  # before the ISA probe, which builds into inductor's cache folder
        import_compiler()
        code_digest()  # the precompiled key's first part: inferno's code read and hashed
    except WarmUpStopped:  # the interpreter is exiting
        pass
    except Exception:  # the warm-up imports it again, and reports what fails
        logger.debug("importing inductor ahead of the warm-up failed", exc_info=True)


# Warm-ups whose thread may still run. A daemon thread still inside a C++ call (a torch op, the compiler) as Python
# 3.11 finalizes is ended by pthread_exit, whose unwinding through noexcept C++ frames aborts the process ("terminate
# called without an active exception", exit code 134): `inferno generate` used to end so whenever its answer came
# before the warm-up's end. The threads are stopped first, while the interpreter is whole.
RUNNING: "weakref.WeakSet[WarmUp]" = weakref.WeakSet()


@atexit.register
def stop_warm_ups() -> None:
    if COMPILER_IMPORT is not None:
        stop_thread(COMPILER_IMPORT)
    for warm_up in list(RUNNING):
        warm_up.stop()


def stop_thread(thread: threading.Thread) -> None:
    """End a warm-up's thread where it is: raises WarmUpStopped in it, which takes effect at its next Python
    instruction (a tile, a traced op, a huge-page chunk, a module imported)."""
    if thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(WarmUpStopped))
        thread.join(WARM_UP_STOP_WAIT)


def lower_thread_priority() -> None:
    """Nice the calling thread (and the processes it starts) on Linux, where a thread has a priority of its own (for
    good: without privileges it cannot be raised again)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WARM_UP_NICENESS)
    except (AttributeError, OSError):
        pass
