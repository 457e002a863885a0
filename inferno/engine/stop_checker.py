"""The one place that decides a request is finished and why, token by token as its new tokens are appended."""
import logging
from collections.abc import Callable

from inferno.request import Request, RequestStatus
from inferno.structured_output.grammar import Grammar

logger = logging.getLogger("inferno")

# feeds a request's newest token to its detokenizer; returns the stop string the text now ends with, if any
StopStringCheck = Callable[[Request], str | None]
# a request's grammar (structured outputs), None when it has none
GrammarLookup = Callable[[str], Grammar | None]


class StopChecker:
    def __init__(self, stop_string: StopStringCheck | None = None, grammar_of: GrammarLookup | None = None):
        self.stop_string = stop_string
        self.grammar_of = grammar_of

    def append_token(self, req: Request, token_id: int) -> bool:
        """Append `token_id` to `req` and decide whether it finished with it, in this order: EOS or a stop token
        (once min_tokens are out; the token stays out of the text), a stop string in the text, its grammar
        complete (structured outputs), max_tokens. Sets the request's finished status and stop_reason."""
        req.append_token(token_id)
        grammar = self.grammar_of(req.request_id) if self.grammar_of is not None else None
        if grammar is not None and token_id not in req.eos_token_ids and not grammar.accept_token(token_id):
            # the sampler only picks allowed tokens; should it not, end the output rather than leave the grammar
            logger.warning("request %s: token %d is not allowed by its grammar (%s); stopping it",
                           req.request_id, token_id, grammar.error)
            return self._finish(req, RequestStatus.FINISHED_STOPPED, None)
        if req.num_output_tokens >= req.sampling_params.min_tokens:
            if token_id in req.eos_token_ids:
                return self._finish(req, RequestStatus.FINISHED_STOPPED, None)
            if token_id in req.sampling_params.stop_token_ids:
                return self._finish(req, RequestStatus.FINISHED_STOPPED, token_id)
        stop = self.stop_string(req) if self.stop_string is not None else None
        if stop is not None:
            return self._finish(req, RequestStatus.FINISHED_STOPPED, stop)
        if grammar is not None and grammar.is_terminated:
            return self._finish(req, RequestStatus.FINISHED_STOPPED, None)
        if req.num_output_tokens >= req.max_tokens:
            return self._finish(req, RequestStatus.FINISHED_LENGTH, None)
        return False

    @staticmethod
    def _finish(req: Request, status: RequestStatus, stop_reason: int | str | None) -> bool:
        req.status, req.stop_reason = status, stop_reason
        return True
