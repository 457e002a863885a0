"""The executor of several ranks over torch.distributed.

Rank 0 is the engine's process: it schedules, broadcasts each step (the plain-data `SchedulerOutput`) on the
control group, runs its own part of the forward pass like every other rank, samples, and proposes the next step's
drafts (speculative decoding) on its own. The other ranks are started here with
`torch.multiprocessing` (spawn) or, under `torchrun`, are the other launched processes; they only run steps.
A rank that dies or stops answering ends the executor: the step raises `ExecutorDeadError` and every rank is
stopped, so nothing hangs.
"""
import logging
import signal
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from inferno.config import EngineConfig
from inferno.distributed.parallel_state import ParallelRank
from inferno.distributed.process_group import init_process_groups, launched_by_torchrun, threads_per_rank
from inferno.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from inferno.executor.abstract import Executor
from inferno.worker.input_batch import StepInput
from inferno.worker.worker import Worker

logger = logging.getLogger("inferno")

WORKER_EXIT_WAIT = 5.0  # seconds a rank gets to exit after shutdown before it is killed


class ExecutorDeadError(RuntimeError):
    """A rank died or stopped answering: the model cannot run any more steps."""


def run_worker(rank: int, config: EngineConfig, store_port: int) -> None:
    """Entry point of a spawned rank."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it stops the ranks
    store = dist.TCPStore("127.0.0.1", store_port, config.world_size, is_master=False)
    parallel, control = init_process_groups(config, rank, store)
    torch.set_num_threads(threads_per_rank(config))
    try:
        worker = Worker(config, parallel)
        dist.barrier(group=control)
        worker.serve(control)
    finally:
        dist.destroy_process_group()


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        if dist.is_initialized():
            raise ValueError("this process already belongs to a torch.distributed process group (another multi-rank "
                             "engine?); shut that engine down first (LLMEngine.shutdown)")
        self.config = config
        self.caller_num_threads = torch.get_num_threads()  # restored on shutdown
        self.processes: list[mp.Process] = []
        self.failure: str | None = None
        self.closed = False
        try:
            if launched_by_torchrun():
                parallel, self.control = init_process_groups(config)
            else:
                parallel, self.control = self._spawn_ranks()
            torch.set_num_threads(threads_per_rank(config))
            worker = Worker(config, parallel)
            dist.barrier(group=self.control)  # every rank holds its shard
        except Exception as e:
            error = self._fail(e, "starting the ranks")
            if isinstance(e, ValueError):  # bad configuration (heads that do not split, too little KV memory)
                raise
            raise error from e
        self.parallel = parallel
        self._expose(worker)
        if parallel.rank != 0:  # torchrun: this process serves rank 0 until it shuts down, then exits
            self.worker.serve(self.control)
            dist.destroy_process_group()
            raise SystemExit(0)

    def _spawn_ranks(self) -> tuple[ParallelRank, dist.ProcessGroup]:
        store = dist.TCPStore("127.0.0.1", 0, self.config.world_size, is_master=True, wait_for_workers=False)
        context = mp.get_context("spawn")
        for rank in range(1, self.config.world_size):
            process = context.Process(target=run_worker, args=(rank, self.config, store.port),
                                      name=f"inferno-rank-{rank}", daemon=True)
            process.start()
            self.processes.append(process)
        return init_process_groups(self.config, 0, store)

    # steps
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Every rank runs the scheduled step; rank 0's sampled output."""
        return self._on_every_rank(sched, self.model_runner.execute_model)

    def run_step(self, step: StepInput) -> torch.Tensor | None:
        """Every rank runs the flat batches of `step` (no request states, no sampling); the logits, on rank 0."""
        return self._on_every_rank(step, self.model_runner.run_step)

    def calibrate_activations(self, sequences: list[list[int]], smoothing: float | None):
        raise ValueError("activation calibration runs on one process: use tensor_parallel_size and "
                         "pipeline_parallel_size 1")

    def _on_every_rank(self, message: SchedulerOutput | StepInput, run: Callable):
        if self.closed:
            raise ExecutorDeadError(self.failure or "the executor is shut down")
        if not self.is_healthy():  # a rank died between steps
            raise self._fail(None, "waiting for a step")
        try:
            self.parallel.broadcast_object(message, self.control)
            return run(message)
        except BaseException as e:  # any rank may now be mid-step: no step can run any more
            error = self._fail(e, "running a step")
            if not isinstance(e, Exception):
                raise
            raise error from e

    # health and shutdown
    def is_healthy(self) -> bool:
        return not self.closed and all(process.is_alive() for process in self.processes)

    def _dead_ranks_message(self, wait: float = 0.0) -> str | None:
        """Which spawned ranks have exited; waits up to `wait` seconds for one to (a dying rank takes a moment)."""
        deadline = time.monotonic() + wait
        while True:
            dead = [(rank, p) for rank, p in enumerate(self.processes, start=1) if p.exitcode is not None]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if not dead:
            return None
        return "; ".join(f"rank {rank} (pid {p.pid}) {_exit_reason(p.exitcode)}" for rank, p in dead)

    def _fail(self, error: BaseException | None, doing: str) -> ExecutorDeadError:
        dead = self._dead_ranks_message(wait=1.0)
        self.failure = (f"a worker rank died while {doing}: {dead}" if dead else
                        f"the ranks failed while {doing}: {type(error).__name__}: {error}")
        logger.error("%s; stopping all ranks", self.failure)
        self.shutdown()
        return ExecutorDeadError(self.failure)

    def shutdown(self) -> None:
        """Stop every rank (rank 0 only); safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        if self.failure is None and dist.is_initialized():
            try:
                dist.broadcast_object_list([None], src=0, group=self.control)
            except Exception:
                logger.warning("could not tell the ranks to stop; killing them")
        for process in self.processes:
            process.join(WORKER_EXIT_WAIT if self.failure is None else 0.1)
            if process.is_alive():
                process.kill()
                process.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self.caller_num_threads)


def _exit_reason(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"
