"""LLMEngine: requests in, RequestOutputs out, one scheduled step at a time."""
import logging
import time
from dataclasses import replace

import torch

from inferno.config import EngineConfig
from inferno.engine.beam_search import BeamSearch
from inferno.engine.kv_cache_manager import KVCacheManager
from inferno.engine.output_processor import OutputProcessor, RequestState, SampleState
from inferno.engine.detokenizer import IncrementalDetokenizer
from inferno.engine.scheduler import Scheduler
from inferno.engine.scheduler_output import ModelRunnerOutput
from inferno.executor import ExecutorDeadError, make_executor
from inferno.outputs import RequestOutput
from inferno.request import Request, RequestStatus
from inferno.sampling_params import SamplingParams
from inferno.spec_decode.draft_model import DraftModelProposer
from inferno.spec_decode.metrics import SpecDecodingStats
from inferno.spec_decode.ngram import NgramProposer
from inferno.worker.kv_cache import log_kv_cache
from inferno.worker.model_runner import ModelRunner

logger = logging.getLogger("inferno")

PromptType = str | dict | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        torch.manual_seed(config.seed)
        self.executor = make_executor(config)
        worker = self.executor.worker
        self.model_path = worker.model_path
        self.model_config = worker.model_config
        self.tokenizer = worker.tokenizer
        self.num_blocks = worker.num_blocks
        try:
            self.max_model_len = self._max_model_len(self.num_blocks * config.block_size)
        except ValueError:
            self.executor.shutdown()
            raise
        log_kv_cache(self.num_blocks, config.block_size, worker.kv_block_bytes,
                     self.max_model_len, auto=config.kv_cache_memory is None)
        self.kv_cache_manager = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_cache_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.beam_searches: dict[str, BeamSearch] = {}
        try:
            self.proposer = self._proposer()
        except Exception:
            self.executor.shutdown()
            raise

    @property
    def model_runner(self) -> ModelRunner:
        """Rank 0's model runner (the only one with one process)."""
        return self.executor.model_runner

    def is_healthy(self) -> bool:
        """False once a rank of a multi-process executor has died (or the engine is shut down)."""
        return self.executor.is_healthy()

    def shutdown(self) -> None:
        """Stop the executor's ranks; the engine cannot run steps afterwards."""
        self.executor.shutdown()

    def _proposer(self) -> NgramProposer | DraftModelProposer | None:
        """Draft tokens are proposed on rank 0, between steps."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec)
        return DraftModelProposer(spec, self.config, self.num_blocks, self.model_config)

    @classmethod
    def from_engine_args(cls, **kwargs) -> "LLMEngine":
        return cls(EngineConfig(**kwargs))

    def _max_model_len(self, cache_tokens: int) -> int:
        """At most what the pool holds for one request, with the slots a draft model writes beyond its tokens:
        a request the pool can never hold would wait forever."""
        spec = self.config.speculative_config
        cache_tokens -= spec.num_lookahead_tokens if spec is not None else 0
        model_len = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is not None:
            if wanted > model_len:
                raise ValueError(f"max_model_len={wanted} is larger than the model's context length {model_len}")
            if wanted > cache_tokens:
                raise ValueError(f"max_model_len={wanted} needs more KV cache than kv_cache_memory holds "
                                 f"({cache_tokens} tokens); raise kv_cache_memory or lower max_model_len")
            return wanted
        if cache_tokens < model_len:
            logger.warning("max_model_len clamped from the model's %d to %d tokens: that is all the KV cache holds "
                           "(raise kv_cache_memory for longer sequences)", model_len, cache_tokens)
            return cache_tokens
        return model_len

    # requests in
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError("prompt must be a string, a list of token ids or a dict with 'prompt' or 'prompt_token_ids'")

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len} "
                             f"(at least one token must be left for the output)")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is out of range for vocabulary size {vocab}")

    def validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: values measured against this model's vocabulary."""
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab}, got {params.stop_token_ids}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab}, got {value}")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if self.output_processor.has_request(request_id) or request_id in self.beam_searches:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_params(params)
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids)
        arrival_time = arrival_time or time.time()
        if params.use_beam_search:
            search = BeamSearch(request_id, text, token_ids, params, self.tokenizer.eos_token_ids,
                                self.max_model_len, arrival_time)
            self.beam_searches[request_id] = search
            self.scheduler.add_request(search.requests[0])
            return
        state = RequestState(request_id, text, token_ids, params)
        for index in range(params.n):
            child_params = params if params.n == 1 else params.child(index)
            if index > 0:
                child_params = replace(child_params, prompt_logprobs=None)
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            req = Request(child_id, token_ids, child_params, self.tokenizer.eos_token_ids, self.max_model_len,
                          arrival_time)
            state.samples.append(SampleState(index, req, IncrementalDetokenizer(self.tokenizer, child_params)))
        self.output_processor.add_request(state)
        leader = state.samples[0].request
        for sample in state.samples:  # the other samples fork the first one's prompt
            self.scheduler.add_request(sample.request, fork_of=None if sample.index == 0 else leader)

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            search = self.beam_searches.pop(rid, None)
            if search is not None:
                search.finish(self.scheduler, RequestStatus.FINISHED_ABORTED)
            state = self.output_processor.states.pop(rid, None)
            if state is None:
                continue
            for sample in state.samples:
                self.output_processor.sample_of.pop(sample.request.request_id, None)
                self.scheduler.finish_request(sample.request.request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states) + len(self.beam_searches)

    # one step
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.requests:
            return []
        try:
            output = self.executor.execute_model(sched)
        except ExecutorDeadError:  # no step can run any more: the engine is done
            self._fail(sched.requests, "the engine's worker ranks died")
            raise
        except Exception as e:  # one bad step ends the requests in it, not the engine
            logger.exception("model step failed; ending the %d requests in it", len(sched.requests))
            return self._fail(sched.requests, f"{type(e).__name__}: {e}")
        updated = self.scheduler.update_from_output(sched, output)
        beams = [req for req in updated if req.beam_search_id is not None]
        outputs = self._advance_beam_searches(beams, output) if beams else []
        updated = [req for req in updated if req.beam_search_id is None]
        self.output_processor.record_logprobs(output)
        for req in updated:
            stop = self.output_processor.detokenize(req)
            if stop is not None:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.spec_policy.plan(self.scheduler.running))
        # a token reaches its user when the step returns: after the drafts for the next step (the draft model's
        # prefill of a new prompt counts in its time to first token)
        now = time.time()
        for req in updated:
            if req.request_id in output.sampled_token_ids:
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
                req.metrics.last_token_time = now
                if req.is_finished:
                    req.metrics.finished_time = now
        return outputs + self.output_processor.make_outputs(updated)

    def _advance_beam_searches(self, beams: list[Request], output: ModelRunnerOutput) -> list[RequestOutput]:
        """Hand each beam's log-probabilities to its search; a search whose beams have all reported advances."""
        touched: dict[str, BeamSearch] = {}
        for req in beams:
            search = self.beam_searches[req.beam_search_id]
            search.record(req, output.logprobs.pop(req.request_id))
            touched[search.request_id] = search
        outputs = []
        for search in touched.values():
            if search.ready and search.advance(self.scheduler):
                del self.beam_searches[search.request_id]
                outputs.append(search.output(self.tokenizer))
        return outputs

    def _fail(self, requests: list[Request], message: str) -> list[RequestOutput]:
        outputs, samples = [], []
        for req in requests:
            search = self.beam_searches.pop(req.beam_search_id, None) if req.beam_search_id is not None else None
            if search is not None:
                search.error = message
                search.finish(self.scheduler, RequestStatus.FINISHED_ERROR)
                outputs.append(search.output(self.tokenizer))
            elif req.beam_search_id is None:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
                _, sample = self.output_processor.sample_of[req.request_id]
                sample.error = message
                samples.append(req)
        return outputs + self.output_processor.make_outputs(samples)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; returns how many were cached."""
        return self.scheduler.reset_prefix_cache()

    # stats
    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks

    @property
    def spec_decoding_stats(self) -> SpecDecodingStats | None:
        """Draft tokens proposed and accepted since the engine started (None without speculative decoding)."""
        return self.scheduler.spec_decoding_stats

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage
