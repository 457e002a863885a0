"""What a proposer's own KV cache holds for a request (a draft model's, an EAGLE head's), and how much of it a later
proposal for the same request can still read."""
from dataclasses import dataclass

import numpy as np

from inferno.worker.request_state import CachedRequestState
from inferno.worker.spec_decode.drafting_request import DraftingRequest


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(mismatch[0]) if len(mismatch) else n


@dataclass(slots=True)
class ProposerCache:
    """K/V written for positions 0.. of a request whose tokens were `token_ids`, in `block_ids`. The K/V at position
    p was computed from the tokens up to p + `tokens_ahead` (an EAGLE head reads token p + 1 with feature p)."""
    state: CachedRequestState  # the request it was written for (a request id may come back as a new request)
    token_ids: list[int]
    block_ids: list[int]
    num_preemptions: int  # the request's count when written: a preemption gave its blocks away
    tokens_ahead: int = 0

    def num_valid_positions(self, req: DraftingRequest, block_size: int) -> int:
        """Leading positions whose K/V can be read now (at most all but the request's last token)."""
        if req.state is not self.state or req.num_preemptions != self.num_preemptions:
            return 0
        # a block replaced since (copy-on-write of a block shared with a fork) holds none of this K/V
        return max(0, min(common_prefix_length(self.token_ids, req.token_ids) - self.tokens_ahead,
                          common_prefix_length(self.block_ids, req.block_ids) * block_size, req.num_tokens - 1))


def live_caches(cached: dict[str, ProposerCache], states: dict[str, CachedRequestState]) -> dict[str, ProposerCache]:
    """The entries whose request is still running (a request gone from the runner's states has ended)."""
    return {rid: c for rid, c in cached.items() if states.get(rid) is c.state}
