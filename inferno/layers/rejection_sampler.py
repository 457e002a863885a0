"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023): verify draft tokens against the target.

A speculating request with drafts d_1..d_k is scored by the target at 1 + k positions, giving p_0..p_k (p_j: the
target's distribution for the token after d_j, every sampling parameter applied). Draft d_(j+1) is accepted with
probability min(1, p_j(d) / q_j(d)); at the first rejection the token is resampled from norm(max(p_j - q_j, 0));
when all k are accepted a bonus token is sampled from p_k. The emitted tokens are then distributed exactly as if
sampled from the target one at a time. A proposer without a distribution (n-gram) is a point mass: q_j is one-hot.
Greedy requests accept while the draft equals the target's argmax, then emit the argmax.
"""
from dataclasses import dataclass

import torch

from inferno.layers.sampler import SamplingMetadata, process_logits, random_sample


@dataclass(slots=True)
class Drafts:
    token_ids: list[int]  # d_1..d_k, k >= 1
    probs: torch.Tensor | None  # [k, vocab] the proposer's q_j; None: one-hot on token_ids
    generator: torch.Generator | None  # the request's own generator (seeded requests)


def rejection_sample(logits: torch.Tensor, md: SamplingMetadata, drafts: list[Drafts]) -> list[list[int]]:
    """logits: [sum(1 + k_i), vocab], request i's rows consecutive (p_0..p_k); `md` has one row per logits row.
    Returns the tokens each request emits: its accepted drafts, then one resampled or bonus token."""
    logits, greedy = process_logits(logits, md)
    num_requests, max_k = len(drafts), max(len(d.token_ids) for d in drafts)
    device = logits.device
    starts = torch.tensor([0] + [len(d.token_ids) + 1 for d in drafts[:-1]], device=device).cumsum(0)
    draft_ids = torch.tensor([d.token_ids + [0] * (max_k - len(d.token_ids)) for d in drafts], device=device)
    valid = torch.tensor([[True] * len(d.token_ids) + [False] * (max_k - len(d.token_ids)) for d in drafts],
                         device=device)
    rows = (starts.unsqueeze(1) + torch.arange(max_k, device=device)).clamp(max=logits.shape[0] - 1)  # p_j
    is_greedy = md.temperature[starts] == 0
    accepted = greedy[rows] == draft_ids
    probs = None
    if not md.all_greedy:
        probs = logits.softmax(dim=-1)
        p = probs[rows, draft_ids]
        q = torch.ones_like(p)
        uniform = torch.rand(num_requests, max_k, device=device)
        for i, d in enumerate(drafts):
            k = len(d.token_ids)
            if d.probs is not None:
                q[i, :k] = d.probs.to(device)[torch.arange(k, device=device), draft_ids[i, :k]]
            if d.generator is not None:
                uniform[i, :k] = torch.rand(k, generator=d.generator, device=device)
        accepted = torch.where(is_greedy.unsqueeze(1), accepted, uniform * q < p)  # u < p / q
    num_accepted = (accepted & valid).int().cumprod(dim=1).sum(dim=1)
    final_rows = starts + num_accepted
    final = greedy[final_rows]
    if probs is not None:
        final = _sample_final(probs, final_rows, num_accepted, is_greedy, drafts, final)
    accepted_counts, final = num_accepted.tolist(), final.tolist()
    return [d.token_ids[:a] + [t] for d, a, t in zip(drafts, accepted_counts, final)]


def _sample_final(probs: torch.Tensor, final_rows: torch.Tensor, num_accepted: torch.Tensor,
                  is_greedy: torch.Tensor, drafts: list[Drafts], final: torch.Tensor) -> torch.Tensor:
    """Random requests: a token from norm(max(p_j - q_j, 0)) after a rejection at j, from p_k after k accepts."""
    random_requests = (~is_greedy).nonzero().squeeze(1).tolist()
    target = probs[final_rows[random_requests]]
    residual = target.clone()
    generators = {}
    for row, i in enumerate(random_requests):
        d, j = drafts[i], int(num_accepted[i])
        if j < len(d.token_ids):
            if d.probs is None:
                residual[row, d.token_ids[j]] = 0.0
            else:
                residual[row] = (target[row] - d.probs[j].to(target.device)).clamp_(min=0.0)
        if d.generator is not None:
            generators[row] = d.generator
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q up to rounding: any token of p is right
    residual = torch.where(empty, target, residual)
    final = final.clone()
    final[random_requests] = random_sample(residual, generators)
    return final
