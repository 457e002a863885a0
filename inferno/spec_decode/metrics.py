"""Counters of speculative decoding: drafts proposed and accepted, in total and per draft position."""
from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0  # verification steps of single requests that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)  # [num_spec_tokens]
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [num_spec_tokens]
    num_disabled_steps: int = 0  # steps where nobody speculated: at least disable_by_batch_size requests ran
    num_paused_proposals: int = 0  # request-steps without drafts because the request's acceptance was too low

    def __post_init__(self) -> None:
        self.num_draft_tokens_per_pos = self.num_draft_tokens_per_pos or [0] * self.num_spec_tokens
        self.num_accepted_tokens_per_pos = self.num_accepted_tokens_per_pos or [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_draft_tokens):
            self.num_draft_tokens_per_pos[pos] += 1
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Fraction of the draft tokens proposed at this position (0 = first draft) that were accepted."""
        return [a / n if n else 0.0 for a, n in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts plus the resampled or bonus token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
