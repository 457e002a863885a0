"""N-gram prompt lookup: find the sequence's last n tokens earlier in the prompt or output, propose what followed."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from inferno.core.scheduler_output import DraftOutput
from inferno.speculative_config import SpeculativeConfig
from inferno.worker.spec_decode.drafting_request import DraftingRequest


def ngram_lookup(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix (max_n down to
    min_n tokens); [] when no suffix of those lengths occurred before."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(token_ids[:-1], n)  # every earlier n-gram (the suffix itself excluded)
        matches = np.flatnonzero((windows == token_ids[-n:]).all(axis=1))
        if len(matches):
            start = int(matches[-1]) + n
            return token_ids[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, requests: list[DraftingRequest]) -> DraftOutput:
        """Up to num_draft_tokens drafts per request (none where no n-gram matches)."""
        out = DraftOutput()
        for req in requests:
            drafts = ngram_lookup(np.asarray(req.token_ids), self.min_n, self.max_n, req.num_draft_tokens)
            if drafts:
                out.spec_token_ids[req.request_id] = drafts
        return out
