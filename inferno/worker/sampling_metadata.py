"""What sampling reads of the requests of a step, as one `SamplingMetadata` row per logits row."""
from typing import Protocol

import torch

from inferno.layers.sampler import SamplingMetadata
from inferno.sampling_params import SamplingParams


class SamplingState(Protocol):
    """What sampling reads of a request: the worker's CachedRequestState, or a DraftingRequest (draft model)."""
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    eos_token_ids: set[int]
    generator: torch.Generator | None

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    def distinct_prompt_tokens(self) -> torch.Tensor: ...


def sampling_metadata(rows: list[tuple[SamplingState, list[int]]], vocab_size: int,
                      bitmasks: list[torch.Tensor | None] | None = None,
                      device: torch.device = torch.device("cpu")) -> SamplingMetadata:
    """One row per (request, draft tokens before the position): penalties and min_tokens see the output so far
    plus those drafts. `bitmasks`: per row, the tokens its grammar allows (None: unconstrained). Tensors on
    `device`, the logits'."""
    requests = [r for r, _ in rows]
    params = [r.sampling_params for r in requests]
    temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], device=device)
    penalty_rows = [i for i, p in enumerate(params)
                    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty]
    banned = {}
    for i, (r, drafts) in enumerate(rows):
        if r.num_output_tokens + len(drafts) < r.sampling_params.min_tokens:
            banned[i] = sorted(r.eos_token_ids | set(r.sampling_params.stop_token_ids))
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    grammar_rows = [i for i, bitmask in enumerate(bitmasks or []) if bitmask is not None]

    def column(name: str, off, dtype) -> torch.Tensor | None:
        values = [getattr(p, name) for p in params]
        if name == "top_k":
            values = [min(k, vocab_size) for k in values]
        return None if all(v == off for v in values) else torch.tensor(values, dtype=dtype, device=device)

    def penalty(name: str) -> torch.Tensor | None:
        if not penalty_rows:
            return None
        return torch.tensor([getattr(params[i], name) for i in penalty_rows], device=device)

    return SamplingMetadata(
        temperature=temperature,
        all_greedy=all(p.greedy for p in params),
        top_k=column("top_k", 0, torch.long),
        top_p=column("top_p", 1.0, torch.float32),
        min_p=column("min_p", 0.0, torch.float32),
        generators={i: r.generator for i, r in enumerate(requests) if r.generator is not None},
        penalty_rows=penalty_rows,
        repetition_penalty=penalty("repetition_penalty"),
        presence_penalty=penalty("presence_penalty"),
        frequency_penalty=penalty("frequency_penalty"),
        prompt_tokens=[requests[i].distinct_prompt_tokens() for i in penalty_rows],
        output_token_ids=[requests[i].output_token_ids + rows[i][1] for i in penalty_rows],
        banned_token_ids={i: t for i, t in banned.items() if t},
        max_num_logprobs=max(wanted) if wanted else None,
        grammar_rows=grammar_rows,
        grammar_bitmask=torch.stack([bitmasks[i] for i in grammar_rows]) if grammar_rows else None,
    )
