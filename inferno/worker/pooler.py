"""Embeddings, on rank 0: the final hidden states (after the final norm) of the prompt positions a pooling request's
pooling reads, gathered chunk by chunk (a long prompt is computed over several steps), and turned into one vector
by the step that completes the prompt."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferno.pooling_params import PoolingParams
from inferno.worker.request_state import CachedRequestState


def pooled_positions(params: PoolingParams, start: int, num_tokens: int, num_prompt_tokens: int) -> range:
    """The positions of the chunk [start, start + num_tokens) whose hidden states the pooling reads: the last
    prompt token's (LAST), the first's (CLS) or every one (MEAN)."""
    end = start + num_tokens
    if params.pooling_type == "MEAN":
        return range(start, end)
    if params.pooling_type == "CLS":
        return range(start, min(start + 1, end)) if start == 0 else range(0)
    return range(end - 1, end) if end == num_prompt_tokens else range(0)


def kv_read_later(params: PoolingParams, start: int, num_tokens: int, num_prompt_tokens: int,
                  prefix_caching: bool) -> bool:
    """Whether a later step reads the K/V of a pooling request's chunk [start, start + num_tokens): the rest of its
    prompt, or later prompts through the prefix cache (which keeps last-token pooling's blocks when it is on, the
    engine's `KVCacheManager.cache_blocks`). A prompt computed whole in one step is otherwise read by no one."""
    whole_prompt = start == 0 and num_tokens == num_prompt_tokens
    return not whole_prompt or (prefix_caching and params.uses_prefix_cache)


@dataclass(slots=True)
class PoolingChunk:
    """A pooling request's chunk in a step."""
    request: CachedRequestState
    rows: range  # its rows among the step's pooling rows (all micro-batches', in order)
    start: int  # the chunk's first position
    completes_prompt: bool


def pool(chunks: list[PoolingChunk], hidden: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Add each chunk's normed hidden states (`hidden`: the step's pooling rows, float32; None when there are
    none) to its request's sum;
    returns the embeddings of the requests whose prompt is complete (float32, on the CPU)."""
    embeddings = {}
    for chunk in chunks:
        req = chunk.request
        if chunk.start == 0:  # the prompt starts (again, after a preemption): nothing gathered counts
            req.pooled = None
        if len(chunk.rows):
            part = hidden[chunk.rows.start:chunk.rows.stop].sum(0)
            req.pooled = part if req.pooled is None else req.pooled + part
        if chunk.completes_prompt:
            embeddings[req.request_id] = embedding(req)
    return embeddings


def embedding(req: CachedRequestState) -> torch.Tensor:
    """The pooled vector: the sum over the pooled positions (the mean for MEAN), cut to `dimensions` (Matryoshka),
    then normalized when asked."""
    params = req.pooling_params
    vector = req.pooled / req.num_prompt_tokens if params.pooling_type == "MEAN" else req.pooled
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if params.normalize:
        vector = F.normalize(vector, dim=-1)
    return vector.cpu()
