"""A request as a proposer sees it: the worker's state plus the tokens its step emitted."""
from dataclasses import dataclass

import torch

from inferno.core.scheduler_output import DraftRequest
from inferno.core.token_counts import TokenCounts
from inferno.sampling_params import SamplingParams
from inferno.worker.request_state import CachedRequestState


@dataclass(slots=True)
class DraftingRequest(TokenCounts):
    state: CachedRequestState
    token_ids: list[int]  # the state's tokens and the ones emitted since (which the state gets with the next step)
    num_draft_tokens: int
    num_preemptions: int
    tree: bool = False  # drafts as a tree (speculative_token_tree), up to num_draft_tokens deep

    @classmethod
    def of(cls, state: CachedRequestState, wanted: DraftRequest) -> "DraftingRequest":
        return cls(state, state.token_ids + wanted.new_token_ids, wanted.num_draft_tokens, wanted.num_preemptions,
                   wanted.tree)

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.state.prompt_token_ids

    @property
    def sampling_params(self) -> SamplingParams:
        return self.state.sampling_params

    @property
    def eos_token_ids(self) -> set[int]:
        return self.state.eos_token_ids

    def distinct_prompt_tokens(self) -> torch.Tensor:
        return self.state.distinct_prompt_tokens()

    @property
    def block_ids(self) -> list[int]:
        return self.state.block_ids

    @property
    def generator(self) -> torch.Generator | None:
        """The request's own generator: draft and target draws of a seeded request come from one stream, in order."""
        return self.state.generator
