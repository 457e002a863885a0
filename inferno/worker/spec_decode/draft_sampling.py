"""A proposer's draft tokens from its logits, with each request's sampling parameters: greedy requests take the
argmax, sampled ones draw from the processed distribution q, which the rejection sampler needs to stay exact."""
import torch

from inferno.layers.sampler import process_logits, random_sample
from inferno.worker.sampling_metadata import SamplingState, sampling_metadata


def sample_drafts(logits: torch.Tensor, rows: list[tuple[SamplingState, list[int]]], vocab_size: int,
                  device: torch.device) -> tuple[list[int], torch.Tensor | None]:
    """One draft per row of `logits` (row i: request rows[i][0] after the drafts rows[i][1]), and the distributions
    they were drawn from (None when every request is greedy)."""
    md = sampling_metadata(rows, vocab_size, device=device)
    logits, greedy = process_logits(logits, md)
    if md.all_greedy:
        return greedy.tolist(), None
    q = logits.softmax(dim=-1)
    sampled = torch.where(md.temperature > 0, random_sample(q, md.generators), greedy)
    return sampled.tolist(), q
