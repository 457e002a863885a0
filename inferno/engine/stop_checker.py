"""The one place that decides a request is finished and why, token by token as its new tokens are appended."""
from collections.abc import Callable

from inferno.request import Request, RequestStatus

# feeds a request's newest token to its detokenizer; returns the stop string the text now ends with, if any
StopStringCheck = Callable[[Request], str | None]


class StopChecker:
    def __init__(self, stop_string: StopStringCheck | None = None):
        self.stop_string = stop_string

    def append_token(self, req: Request, token_id: int) -> bool:
        """Append `token_id` to `req` and decide whether it finished with it, in this order: EOS or a stop token
        (once min_tokens are out; the token stays out of the text), a stop string in the text, max_tokens. Sets
        the request's finished status and stop_reason."""
        req.append_token(token_id)
        if req.num_output_tokens >= req.sampling_params.min_tokens:
            if token_id in req.eos_token_ids:
                return self._finish(req, RequestStatus.FINISHED_STOPPED, None)
            if token_id in req.sampling_params.stop_token_ids:
                return self._finish(req, RequestStatus.FINISHED_STOPPED, token_id)
        stop = self.stop_string(req) if self.stop_string is not None else None
        if stop is not None:
            return self._finish(req, RequestStatus.FINISHED_STOPPED, stop)
        if req.num_output_tokens >= req.max_tokens:
            return self._finish(req, RequestStatus.FINISHED_LENGTH, None)
        return False

    @staticmethod
    def _finish(req: Request, status: RequestStatus, stop_reason: int | str | None) -> bool:
        req.status, req.stop_reason = status, stop_reason
        return True
