"""The target's final hidden states kept for an EAGLE head: per request, those of the positions the target has
run and accepted (prompt chunks, decodes, accepted drafts) since the head last read them. The head's KV cache
needs the target's feature at every position (its K/V at p come from the token at p + 1 and the feature at p), not
only at the last one, and a request may go steps without drafting (a prefill in chunks, a paused or busy batch):
what it has not read waits here, in the model dtype (per token a fraction of the target's own KV bytes), until
the head reads it or the request ends."""
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class HiddenRun:
    start: int  # the position of the first row
    states: torch.Tensor  # [n, hidden], before the target's final norm

    @property
    def end(self) -> int:
        return self.start + self.states.shape[0]


class TargetHiddenStates:
    def __init__(self) -> None:
        self.runs: dict[str, HiddenRun] = {}

    def record(self, request_id: str, start: int, states: torch.Tensor) -> None:
        """The states of positions start.. ; they replace any kept from `start` on (a recomputation after a
        preemption or of rejected drafts); a run that does not continue the kept one replaces it."""
        run = self.runs.get(request_id)
        if run is None or not run.start <= start <= run.end:
            self.runs[request_id] = HiddenRun(start, states.clone())
        else:
            run.states = torch.cat([run.states[:start - run.start], states])

    def take(self, request_id: str, start: int, end: int, template: torch.Tensor) -> torch.Tensor:
        """States [end - start, hidden] of positions start..end-1 (zeros where none were kept: positions the target
        did not run for this request, such as a prefix-cache hit), and forget every kept position before `end`.
        `template`: a tensor of the states' width, dtype and device."""
        out = template.new_zeros(end - start, template.shape[-1])
        run = self.runs.get(request_id)
        if run is not None:
            first, last = max(start, run.start), min(end, run.end)
            if first < last:
                out[first - start:last - start] = run.states[first - run.start:last - run.start]
            if run.end <= end:
                del self.runs[request_id]
            else:
                run.states, run.start = run.states[max(end - run.start, 0):], max(end, run.start)
        return out

    def keep_only(self, request_ids) -> None:
        """Forget the requests that ended."""
        for rid in [rid for rid in self.runs if rid not in request_ids]:
            del self.runs[rid]
