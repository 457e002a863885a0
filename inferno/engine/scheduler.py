"""Iteration-level scheduler: one token budget per step, decodes first, then waiting requests FCFS.

Every request has `num_computed_tokens` and `num_tokens`; a step hands out tokens so that computed catches up.
Prefill, chunked prefill, decode and recompute after preemption are all the same mechanism. A request admitted
from the waiting queue starts after its longest prefix-cache hit. The samples of an n > 1 request wait until the
first sample has computed the prompt, then fork its blocks and compute only the prompt's last token themselves.
A request with structured outputs stays waiting until its grammar is compiled; the requests behind it go ahead.
A decode instance's request whose prompt was computed by a prefill instance is admitted with blocks for its
prompt, then waits off the batch until its KV has been pulled (engine/kv_transfer.py).
An embedding request (`pooling_params`) is a prompt-only request: chunked and batched like any prompt, it ends in
the step that completes its prompt, with the vector rank 0 pooled, and gives its blocks back.
"""
import time
from collections import deque

from inferno.config import EngineConfig
from inferno.core.scheduler_output import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from inferno.core.spec_tree import SpecTree
from inferno.engine.kv_cache_manager import KVCacheManager
from inferno.engine.kv_transfer import KVTransferManager
from inferno.engine.stop_checker import StopChecker
from inferno.engine.worker_view import WorkerView
from inferno.request import Request, RequestStatus
from inferno.spec_decode.metrics import SpecDecodingStats
from inferno.spec_decode.policy import SpeculationPolicy
from inferno.structured_output.manager import StructuredOutputManager


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager, stop_checker: StopChecker,
                 structured_output: StructuredOutputManager, kv_transfers: KVTransferManager | None = None):
        self.stop_checker = stop_checker
        self.kv_transfers = kv_transfers
        self.structured_output = structured_output
        self.worker_view = WorkerView()
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.max_loras = config.max_loras  # distinct LoRA adapters among the running requests (one step's)
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.forks: dict[str, list[Request]] = {}  # request id -> requests waiting to fork its prompt
        self.num_preemptions = 0
        self.num_computed_prompt_tokens = 0  # prompt tokens run through the model (prefix-cache hits excluded)
        spec = config.speculative_config
        self.num_lookahead_tokens = spec.num_lookahead_tokens if spec else 0
        self.spec_decoding_stats = SpecDecodingStats(spec.num_speculative_tokens) if spec else None
        self.spec_policy = SpeculationPolicy(spec, self.spec_decoding_stats) if spec else None

    def add_request(self, request: Request, fork_of: Request | None = None) -> None:
        """Queue a request; with `fork_of`, it starts once that request has computed the (same) prompt."""
        self.requests[request.request_id] = request
        if fork_of is None:
            self.waiting.append(request)
        else:
            self.forks.setdefault(fork_of.request_id, []).append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or (self.kv_transfers is not None and self.kv_transfers.pulling))

    def fork_request(self, parent: Request, child: Request) -> None:
        """Start `child` running on a copy of the parent's block table, from where the parent has computed."""
        self.kv_cache_manager.fork(parent, child, parent.num_computed_tokens)
        self.requests[child.request_id] = child
        self._start(child)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        spec_token_ids: dict[str, list[int]] = {}
        preempted: list[Request] = []
        # running requests: decodes first, then unfinished prefill chunks
        ordered = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for req in ordered:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            # a decode with k draft tokens is scheduled as 1 + k tokens (fewer drafts when the budget is short)
            num_new = min(req.num_tokens - req.num_computed_tokens + len(req.spec_token_ids), budget)
            if num_new == 0:
                continue  # a beam waiting for the rest of its beam search
            while not self.kv_cache_manager.allocate_slots(req, num_new + self.num_lookahead_tokens):
                victim = self.running[-1]
                budget += scheduled.pop(victim.request_id, 0)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = num_new
                budget -= num_new
                num_drafts = num_new - (req.num_tokens - req.num_computed_tokens)
                if num_drafts > 0:  # a tree's first nodes in its layout are a tree too
                    spec_token_ids[req.request_id] = req.spec_token_ids[:num_drafts]
        # waiting requests, first come first served; none while memory is short
        passed_over: list[Request] = []  # their grammar is not compiled yet, or their LoRA adapter has no slot
        loras = {r.lora_int_id for r in self.running} - {0}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            adapter_waits = req.lora_int_id and req.lora_int_id not in loras and len(loras) >= self.max_loras
            if adapter_waits or not self.structured_output.is_ready(req.request_id):
                passed_over.append(self.waiting.popleft())
                continue
            hits = self.kv_cache_manager.get_computed_blocks(req)
            if req.remote_prefill is not None:  # blocks for the whole prompt; its KV comes from a prefill instance
                num_missing = req.num_tokens - len(hits or ()) * self.kv_cache_manager.block_size
                if not self.kv_cache_manager.allocate_slots(req, num_missing, hits):
                    break
                self.waiting.popleft()
                self.kv_transfers.start_pull(req, len(hits or ()))
                continue
            num_new = min(req.num_tokens - len(hits or ()) * self.kv_cache_manager.block_size, budget)
            if not self.kv_cache_manager.allocate_slots(req, num_new + self.num_lookahead_tokens, hits):
                break
            self.waiting.popleft()
            self._start(req)
            scheduled[req.request_id] = num_new
            budget -= num_new
            if req.lora_int_id:
                loras.add(req.lora_int_id)
        self.waiting.extendleft(reversed(passed_over))
        return self._scheduler_output(scheduled, spec_token_ids)

    def _scheduler_output(self, scheduled: dict[str, int], spec_token_ids: dict[str, list[int]]) -> SchedulerOutput:
        """The step as plain data: requests new to the worker whole, the others as what changed."""
        new_reqs, cached = [], CachedRequestData()
        draft_probs, tree_parents = {}, {}
        for rid, n in scheduled.items():
            req = self.requests[rid]
            self.num_computed_prompt_tokens += max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens)
                                                   - req.num_computed_tokens)
            if self.worker_view.knows(rid):
                self.worker_view.add_cached(req, cached)
            else:
                new_reqs.append(self.worker_view.new_request_data(req))
            if rid in spec_token_ids and req.draft_probs is not None:
                draft_probs[rid] = req.draft_probs[:len(spec_token_ids[rid])]
            if rid in spec_token_ids and req.spec_tree_parents is not None:
                tree_parents[rid] = req.spec_tree_parents[:len(spec_token_ids[rid])]
        finished = self.worker_view.take_finished() if scheduled else set()  # else: sent with the next step
        sampling = {rid: spec_token_ids.get(rid, []) for rid, n in scheduled.items()
                    if self.requests[rid].num_computed_tokens + n >= self.requests[rid].num_tokens}
        return SchedulerOutput(new_reqs, cached, scheduled, spec_token_ids, draft_probs, tree_parents,
                               self.kv_cache_manager.take_block_copies(), finished,
                               self.structured_output.bitmasks(sampling))

    def _start(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.time()
        self.running.append(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids, req.draft_probs, req.spec_tree_parents = [], None, None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish stopped requests and embedding requests whose
        prompt is complete; returns the requests that got a new token, a prompt-logprob chunk or their embedding.
        Rejected draft tokens are not computed: their KV slots are written again by later steps, and a block enters
        the prefix cache only once all its tokens are accepted."""
        updated = []
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.requests[rid]
            drafts = sched.spec_token_ids.get(req.request_id, [])
            req.spec_token_ids, req.draft_probs, req.spec_tree_parents = [], None, None
            tokens = output.sampled_token_ids.get(req.request_id)
            num_rejected = len(drafts) - (len(tokens) - 1) if tokens is not None and drafts else 0
            req.num_computed_tokens += n - num_rejected  # a tree's: its root and accepted path (moved into place)
            if drafts and self.spec_decoding_stats is not None:  # a tree counts as the chain of its depth
                parents = sched.spec_tree_parents.get(rid)
                depth = len(drafts) if parents is None else SpecTree(tuple(parents)).depth
                self.spec_decoding_stats.observe(depth, len(drafts) - num_rejected)
                self.spec_policy.observe(req.request_id, depth, len(drafts) - num_rejected)
            stopped = False
            if tokens is not None and req.beam_search_id is None:  # a beam's search appends its tokens itself
                for token in tokens:  # stop checks token by token; tokens after a stop are dropped
                    if self.stop_checker.append_token(req, token):
                        stopped = True
                        break
                # tokens after a stop were dropped: only what is in token_ids counts as computed
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            self.kv_cache_manager.cache_blocks(req)
            pooled = output.pooler_output.get(rid)
            if pooled is not None:  # an embedding request's prompt is complete: it ends with its vector
                req.pooled = pooled
                req.status = RequestStatus.FINISHED_STOPPED
                self._free(req)
                updated.append(req)
                continue
            if req.request_id in self.forks and req.num_computed_tokens >= req.num_prompt_tokens:
                self._start_forks(req)
            if stopped:
                self._free(req)
            if tokens is not None or req.request_id in output.prompt_logprobs:
                updated.append(req)
        return updated

    def finish_kv_pull(self, req: Request, error: str | None) -> bool:
        """A request's pulled KV arrived (error None): its prompt counts as computed, the prefill instance's first
        token is appended and it runs (or stops on that token). On an error its prompt is computed here instead.
        Returns whether the request got its first token."""
        first_token = req.remote_prefill.first_token_id
        req.remote_prefill = None
        if error is not None:
            self.kv_cache_manager.free(req)
            req.num_computed_tokens = 0
            self.waiting.appendleft(req)
            return False
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv_cache_manager.cache_blocks(req)
        self._start(req)
        if req.request_id in self.forks:
            self._start_forks(req)
        if self.stop_checker.append_token(req, first_token):
            self._free(req)
        return True

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status != RequestStatus.RUNNING and req in self.waiting:
            self.waiting.remove(req)
        for siblings in self.forks.values():
            if req in siblings:
                siblings.remove(req)
        if not req.is_finished:
            req.status = status
        self._free(req)
        return req

    def _free(self, req: Request) -> None:
        """Take a finished request out of the running batch and give its blocks back."""
        if req in self.running:
            self.running.remove(req)
        kv = self.kv_transfers
        if kv is not None and kv.is_pulling(req):
            pass  # its blocks are being written: freed when the pull is over
        elif kv is not None and kv.wants_hold(req):
            kv.hold(req)
        else:
            self.kv_cache_manager.free(req)
        self.requests.pop(req.request_id, None)
        self.worker_view.forget(req.request_id)
        self.structured_output.remove(req.request_id)
        # its prompt was never computed: the requests waiting to fork it compute the prompt themselves
        self.waiting.extendleft(reversed(self.forks.pop(req.request_id, [])))

    def _start_forks(self, req: Request) -> None:
        """The prompt is computed: each waiting sibling shares its K/V and computes only the last prompt token
        (which gives its own first sample)."""
        for sibling in self.forks.pop(req.request_id):
            self.kv_cache_manager.fork(req, sibling, req.num_prompt_tokens - 1)
            self._start(sibling)

    def reset_prefix_cache(self) -> int:
        return self.kv_cache_manager.reset_prefix_cache()
