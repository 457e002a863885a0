"""What the worker holds of each request, kept on the engine's side so a step carries only what changed.

The worker learns a request whole the first time it is scheduled (`NewRequestData`) and keeps it until the request
ends; after that a step sends the tokens appended since (sampled ones, a beam's chosen ones) and the block ids
added — or the whole block table again when it changed otherwise (freed on preemption, a block copied on write).
"""
from inferno.core.scheduler_output import CachedRequestData, DraftRequest, NewRequestData
from inferno.request import Request


class WorkerView:
    def __init__(self) -> None:
        self.num_tokens: dict[str, int] = {}  # request id -> tokens of it the worker holds
        self.block_ids: dict[str, list[int]] = {}  # request id -> the block table the worker holds
        self.finished_req_ids: set[str] = set()  # ended since the last step that was sent

    def new_request_data(self, req: Request) -> NewRequestData:
        self.num_tokens[req.request_id] = req.num_tokens
        self.block_ids[req.request_id] = list(req.block_ids)
        return NewRequestData(req.request_id, req.prompt_token_ids, req.output_token_ids, req.sampling_params,
                              req.eos_token_ids, list(req.block_ids), req.num_computed_tokens, req.pooling_params,
                              req.lora_request)

    def add_cached(self, req: Request, cached: CachedRequestData) -> None:
        rid = req.request_id
        cached.req_ids.append(rid)
        cached.new_token_ids.append(req.token_ids[self.num_tokens[rid]:])
        self.num_tokens[rid] = req.num_tokens
        known = self.block_ids[rid]
        reset = req.block_ids[:len(known)] != known
        cached.new_block_ids.append(list(req.block_ids) if reset else req.block_ids[len(known):])
        cached.reset_block_ids.append(reset)
        cached.num_computed_tokens.append(req.num_computed_tokens)
        if reset or len(known) != len(req.block_ids):
            self.block_ids[rid] = list(req.block_ids)

    def draft_requests(self, planned: list[tuple[Request, int]], trees: set[str] = frozenset()) -> list[DraftRequest]:
        """The speculation policy's plan as plain data (`trees`: the requests that propose a tree), with the tokens
        the worker was not sent yet (it gets them only with the request's next step); requests the worker has not
        seen yet wait for a later plan."""
        return [DraftRequest(req.request_id, k, req.token_ids[self.num_tokens[req.request_id]:], req.num_preemptions,
                             req.request_id in trees)
                for req, k in planned if self.knows(req.request_id)]

    def knows(self, request_id: str) -> bool:
        return request_id in self.num_tokens

    def forget(self, request_id: str) -> None:
        """The request ended: the next step tells the worker to drop it."""
        if self.num_tokens.pop(request_id, None) is not None:
            del self.block_ids[request_id]
            self.finished_req_ids.add(request_id)

    def take_finished(self) -> set[str]:
        finished, self.finished_req_ids = self.finished_req_ids, set()
        return finished
