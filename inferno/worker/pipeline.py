"""Pipeline parallelism: each stage runs its layers over every micro-batch of the step in turn and passes the
hidden states on with point-to-point sends.

Sends are asynchronous, so a stage starts micro-batch i + 1 while the next stage works on micro-batch i. The last
stage sends the final hidden states of the logit and pooling rows back to the first stage (which holds the LM head and samples),
where the logits of micro-batch i are computed while later stages still work on i + 1.
"""
from collections.abc import Callable, Iterator

import torch

from inferno.distributed.parallel_state import ParallelRank
from inferno.worker.input_batch import MicroBatch, StepInput

# this stage's layers over one micro-batch, given the previous stage's hidden states (None on the first stage)
StageForward = Callable[[MicroBatch, torch.Tensor | None], torch.Tensor]


def run_first_stage(forward: StageForward, step: StepInput, parallel: ParallelRank, hidden_size: int,
                    dtype: torch.dtype, device: torch.device) -> Iterator[torch.Tensor]:
    """Embed and run the first layers of each micro-batch, send them on; then yield the final hidden states of each
    micro-batch's output rows (logit rows, then pooling rows) as the last stage returns them."""
    sends = [parallel.send(forward(mb, None), 1, tag=i) for i, mb in enumerate(step.micro_batches)]
    for i, mb in enumerate(step.micro_batches):
        if mb.output_rows:
            hidden = torch.empty(len(mb.output_rows), hidden_size, dtype=dtype, device=device)
            yield parallel.recv(hidden, parallel.pp_size - 1, tag=i)
    parallel.wait(sends)


def run_later_stage(forward: StageForward, step: StepInput, parallel: ParallelRank, hidden_size: int,
                    dtype: torch.dtype, device: torch.device) -> None:
    sends = []
    for i, mb in enumerate(step.micro_batches):
        hidden = torch.empty(len(mb.input_ids), hidden_size, dtype=dtype, device=device)
        hidden = forward(mb, parallel.recv(hidden, parallel.pp_rank - 1, tag=i))
        if not parallel.is_last_stage:
            sends.append(parallel.send(hidden, parallel.pp_rank + 1, tag=i))
        elif mb.output_rows:
            sends.append(parallel.send(hidden[mb.output_rows].contiguous(), 0, tag=i))
    parallel.wait(sends)
