"""When and how much to speculate: switched off for large batches, and per request by its recent acceptance.

Each request keeps decayed counts of its accepted drafts and of its rejections (a verification step with d drafts
of which a were accepted adds a successes, and one failure when a < d). Under the usual model where each draft is
accepted with the same chance α once the ones before it were, α = accepted / (accepted + rejections) and draft
position j is reached and accepted with chance α^j: it is proposed only while α^j >= the threshold. A request whose
first position falls below it stops proposing (no draft passes, no verified tokens) and, every PROBE_INTERVAL steps
it could have speculated, proposes a single draft to find out whether acceptance came back.

With a token tree configured, a request proposes its tree (cut to the depth it would give a chain) only while at
most TREE_MAX_RUNNING requests run: a batch of decodes on a CPU is compute-bound, and a tree's extra rows would
slow every request of a busy one. A constrained request (its grammar checks drafts along a chain) and one too near
its max_tokens to hold the whole tree propose a chain.
"""
import math
from dataclasses import dataclass

from inferno.request import Request
from inferno.spec_decode import num_drafts_wanted
from inferno.spec_decode.metrics import SpecDecodingStats
from inferno.speculative_config import SpeculativeConfig

PROBE_INTERVAL = 8  # steps a paused request waits before proposing one draft again
DECAY = 0.8  # weight of the previous counts at each verification step (recent steps matter most)
PRIOR_ACCEPTED = 2.0  # a new request starts as if its drafts had been accepted: it speculates fully at first
TREE_MAX_RUNNING = 2  # trees only while this few requests run


@dataclass(slots=True)
class Acceptance:
    accepted: float = PRIOR_ACCEPTED
    rejected: float = 0.0
    paused_steps: int = 0  # steps since the request last proposed while its acceptance was too low

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class SpeculationPolicy:
    def __init__(self, config: SpeculativeConfig, stats: SpecDecodingStats):
        self.k = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        self.threshold = config.draft_acceptance_threshold
        self.tree_size = config.num_tree_drafts
        self.stats = stats
        self.acceptance: dict[str, Acceptance] = {}

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification step of `request_id`: `num_accepted` of its `num_drafts` drafts were accepted."""
        a = self.acceptance.setdefault(request_id, Acceptance())
        a.accepted = DECAY * a.accepted + num_accepted
        a.rejected = DECAY * a.rejected + (num_accepted < num_drafts)

    def plan(self, running: list[Request]) -> list[tuple[Request, int]]:
        """The requests that propose drafts for the next step and how many each (at most num_speculative_tokens,
        never past max_tokens)."""
        self.acceptance = {r.request_id: self.acceptance[r.request_id] for r in running
                           if r.request_id in self.acceptance}
        eligible = [(req, k) for req in running if (k := num_drafts_wanted(req, self.k)) > 0]
        if not eligible:
            return []
        if self.disable_by_batch_size is not None and len(running) >= self.disable_by_batch_size:
            self.stats.num_disabled_steps += 1
            return []
        planned = []
        for req, k in eligible:
            k = min(k, self._num_drafts(req.request_id))
            if k > 0:
                planned.append((req, k))
        return planned

    def tree_requests(self, planned: list[tuple[Request, int]], num_running: int) -> set[str]:
        """The planned requests that propose a tree rather than a chain."""
        if self.tree_size is None or num_running > TREE_MAX_RUNNING:
            return set()
        return {req.request_id for req, _ in planned if req.sampling_params.structured_outputs is None
                and num_drafts_wanted(req, self.tree_size) == self.tree_size}

    def _num_drafts(self, request_id: str) -> int:
        if self.threshold == 0:
            return self.k
        a = self.acceptance.setdefault(request_id, Acceptance())
        rate = a.rate
        if rate >= 1.0:
            return self.k
        if rate < self.threshold:  # paused: one draft every PROBE_INTERVAL steps
            a.paused_steps += 1
            if a.paused_steps < PROBE_INTERVAL:
                self.stats.num_paused_proposals += 1
                return 0
            a.paused_steps = 0
            return 1
        # the largest j with rate ** j >= threshold
        return min(self.k, int(math.log(self.threshold) / math.log(rate) + 1e-9))
