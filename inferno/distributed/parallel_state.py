"""Where one process sits among the ranks: its tensor-parallel group and its pipeline stage.

Ranks are laid out stage-major: rank = pp_rank * tp_size + tp_rank, so the ranks of one stage form one
tensor-parallel group and global rank 0 is tensor rank 0 of the first stage (the one that schedules and samples).
"""
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(slots=True)
class CommStats:
    """Per kind of call (all_reduce, gather, send, recv, broadcast): seconds this rank spent in communication
    calls, waiting for the other ranks included, and the number of calls."""
    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, start: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - start
        self.calls[kind] = self.calls.get(kind, 0) + 1


@dataclass(slots=True)
class ParallelRank:
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    tp_group: dist.ProcessGroup | None = None  # None when tp_size == 1
    comm: CommStats = field(default_factory=CommStats)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank holding this rank's tensor shard in stage `pp_rank`."""
        return pp_rank * self.tp_size + self.tp_rank

    def stage_layers(self, num_layers: int) -> range:
        """This stage's decoder layers: an even split, the remainder going to the last stages (the first
        stage also embeds, computes logits and samples)."""
        if num_layers < self.pp_size:
            raise ValueError(f"pipeline_parallel_size={self.pp_size} is larger than the model's {num_layers} layers")
        base, extra = divmod(num_layers, self.pp_size)
        sizes = [base + (s >= self.pp_size - extra) for s in range(self.pp_size)]
        start = sum(sizes[:self.pp_rank])
        return range(start, start + sizes[self.pp_rank])

    # communication (timed)
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        dist.all_reduce(x, group=self.tp_group)
        self.comm.add("all_reduce", start)
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every tensor rank's `x` (equal shapes), in rank order, on tensor rank 0; None elsewhere."""
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(x, parts, group_dst=0, group=self.tp_group)
        self.comm.add("gather", start)
        return parts

    def send(self, x: torch.Tensor, pp_rank: int, tag: int) -> dist.Work:
        start = time.perf_counter()
        work = dist.isend(x, self.stage_rank(pp_rank), tag=tag)
        self.comm.add("send", start)
        return work

    def recv(self, x: torch.Tensor, pp_rank: int, tag: int) -> torch.Tensor:
        start = time.perf_counter()
        dist.recv(x, self.stage_rank(pp_rank), tag=tag)
        self.comm.add("recv", start)
        return x

    def wait(self, works: list[dist.Work]) -> None:
        start = time.perf_counter()
        for work in works:
            work.wait()
        self.comm.add("send", start)

    def broadcast_object(self, obj: object, group: dist.ProcessGroup) -> object:
        """`obj` from global rank 0, on every rank."""
        start = time.perf_counter()
        message = [obj]
        dist.broadcast_object_list(message, src=0, group=group)
        self.comm.add("broadcast", start)
        return message[0]


SINGLE = ParallelRank()
