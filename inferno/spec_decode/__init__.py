"""Speculative decoding, the engine's side: which requests speculate and how much (policy.py), and the counters
(metrics.py). The proposers run on rank 0 of the executor (inferno/worker/spec_decode/)."""
from inferno.request import Request, RequestStatus


def num_drafts_wanted(request: Request, num_speculative_tokens: int) -> int:
    """How many draft tokens to propose for a request after this step (0: it does not speculate).

    Only requests that decode next (their one new token is all that is left to compute) speculate, and never past
    max_tokens: a step emits at most drafts + 1 tokens. Requests that want logprobs do not speculate (their
    logprobs would have to come from the verification pass), nor do beams (their search picks every token), nor
    embedding requests (they never decode)."""
    if (request.status != RequestStatus.RUNNING or request.sampling_params.logprobs is not None
            or request.beam_search_id is not None or request.pooling_params is not None):
        return 0
    if request.num_computed_tokens != request.num_tokens - 1:
        return 0
    return max(0, min(num_speculative_tokens, request.max_tokens - request.num_output_tokens - 1))
