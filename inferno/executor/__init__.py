"""Executors run one scheduled step on one process (`UniProcExecutor`) or on several ranks over
torch.distributed (`MultiprocExecutor`: tensor and pipeline parallelism)."""
import os

from inferno.config import EngineConfig
from inferno.distributed.process_group import launched_by_torchrun
from inferno.executor.abstract import Executor
from inferno.executor.multiproc import ExecutorDeadError, MultiprocExecutor
from inferno.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "ExecutorDeadError", "make_executor"]


def make_executor(config: EngineConfig) -> Executor:
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) != config.world_size:
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes but tensor_parallel_size x "
                         f"pipeline_parallel_size is {config.world_size}; launch exactly that many")
    return MultiprocExecutor(config) if config.world_size > 1 else UniProcExecutor(config)
