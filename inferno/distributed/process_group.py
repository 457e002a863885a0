"""Process groups of the ranks: started by inferno on one machine (a TCPStore on rank 0) or by `torchrun`
(env:// rendezvous, one machine or many)."""
import os
from datetime import timedelta

import torch.distributed as dist

from inferno.config import EngineConfig
from inferno.distributed.parallel_state import ParallelRank

# the model's tensors travel over NCCL between GPUs, over gloo between CPU processes (and the control group always)
BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
# Ranks other than 0 wait for the next step on the control group for as long as the engine is idle.
CONTROL_TIMEOUT = timedelta(days=365)


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def local_world_size(config: EngineConfig) -> int:
    """Ranks on this machine."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", config.world_size)) if launched_by_torchrun() else config.world_size


def threads_per_rank(config: EngineConfig) -> int:
    """The machine's cores divided among its ranks, unless `num_threads` says otherwise."""
    return config.num_threads or max(1, len(os.sched_getaffinity(0)) // local_world_size(config))


def init_process_groups(config: EngineConfig, rank: int | None = None,
                        store: dist.Store | None = None) -> tuple[ParallelRank, dist.ProcessGroup]:
    """Join the default group (`store` given: inferno's own launch; else env:// from torchrun) and create the
    tensor-parallel groups and the control group that carries each step from rank 0. Collectives inside a step
    fail after `distributed_timeout` seconds; the control group waits for as long as the engine is idle."""
    timeout = timedelta(seconds=config.distributed_timeout)
    if store is None:
        dist.init_process_group(BACKENDS[config.device], init_method="env://", timeout=timeout)
        rank = dist.get_rank()
    else:
        dist.init_process_group(BACKENDS[config.device], store=store, rank=rank, world_size=config.world_size,
                                timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    tp_group = None
    for stage in range(pp):  # every rank creates every group, in the same order
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks, timeout=timeout) if tp > 1 else None
        if rank in ranks:
            tp_group = group
    return ParallelRank(rank, tp, pp, tp_group), control
