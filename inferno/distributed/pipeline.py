"""Pipeline parallelism: each stage runs its layers over every micro-batch of the step in turn and passes the
hidden states on with point-to-point sends.

Sends are asynchronous, so a stage starts micro-batch i + 1 while the next stage works on micro-batch i. The last
stage sends the final hidden states of the logit rows back to the first stage (which holds the LM head and samples),
where the logits of micro-batch i are computed while later stages still work on i + 1.
"""
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from inferno.distributed.parallel_state import ParallelRank
from inferno.worker.input_batch import StepInput

if TYPE_CHECKING:
    from inferno.worker.model_runner import ModelRunner


def run_first_stage(runner: "ModelRunner", step: StepInput, parallel: ParallelRank) -> Iterator[torch.Tensor]:
    """Embed and run the first layers of each micro-batch, send them on; then yield the final hidden states of each
    micro-batch's logit rows as the last stage returns them."""
    sends = [parallel.send(runner.forward(mb), 1, tag=i) for i, mb in enumerate(step.micro_batches)]
    hidden_size = runner.config.hidden_size
    for i, mb in enumerate(step.micro_batches):
        if mb.logit_rows:
            hidden = torch.empty(len(mb.logit_rows), hidden_size, dtype=runner.dtype)
            yield parallel.recv(hidden, parallel.pp_size - 1, tag=i)
    parallel.wait(sends)


def run_later_stage(runner: "ModelRunner", step: StepInput, parallel: ParallelRank) -> None:
    sends = []
    for i, mb in enumerate(step.micro_batches):
        hidden = torch.empty(len(mb.input_ids), runner.config.hidden_size, dtype=runner.dtype)
        hidden = runner.forward(mb, parallel.recv(hidden, parallel.pp_rank - 1, tag=i))
        if not parallel.is_last_stage:
            sends.append(parallel.send(hidden, parallel.pp_rank + 1, tag=i))
        elif mb.logit_rows:
            sends.append(parallel.send(hidden[mb.logit_rows].contiguous(), 0, tag=i))
    parallel.wait(sends)
