"""LLMEngine: requests in, RequestOutputs out, one scheduled step at a time."""
import logging
import time
from dataclasses import replace

import torch

from inferno.config import EngineConfig
from inferno.engine.beam_search import BeamSearch
from inferno.engine.kv_cache_manager import KVCacheManager, log_kv_cache
from inferno.engine.output_processor import OutputProcessor, RequestState, SampleState
from inferno.engine.detokenizer import IncrementalDetokenizer
from inferno.engine.input_processor import InputProcessor, PromptType
from inferno.engine.kv_transfer import KVTransferManager
from inferno.engine.scheduler import Scheduler
from inferno.engine.stop_checker import StopChecker
from inferno.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from inferno.core.startup_gc import gc_paused
from inferno.executor import ExecutorDeadError, make_executor
from inferno.lora_request import LoRARequest
from inferno.openmp import release_thread_pool
from inferno.outputs import PoolingRequestOutput, RequestOutput
from inferno.pooling_params import PoolingParams
from inferno.request import Request, RequestStatus
from inferno.sampling_params import RequestOutputKind, SamplingParams
from inferno.spec_decode.metrics import SpecDecodingStats
from inferno.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("inferno")
GRAMMAR_POLL_S = 0.02  # a step with nothing to run but grammars compiling waits this long for one
# a step with nothing to run but KV transfers waits this long for one to end (new requests are taken after it)
KV_TRANSFER_POLL_S = 0.005
# the sampling parameters of an embedding request, which samples nothing: every sampling feature off
PROMPT_ONLY = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)

class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        torch.manual_seed(config.seed)
        with gc_paused():  # loading builds objects that all live on (core/startup_gc.py)
            self.executor = make_executor(config)
        self.model_path = self.executor.model_path
        self.model_config = self.executor.model_config
        self.tokenizer = self.executor.tokenizer
        self.num_blocks = self.executor.num_blocks
        try:
            self.max_model_len = self._max_model_len(self.num_blocks * config.block_size)
        except ValueError:
            self.executor.shutdown()
            raise
        log_kv_cache(self.num_blocks, config.block_size, self.executor.kv_block_bytes,
                     self.max_model_len, auto=config.kv_cache_memory is None)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config, self.max_model_len)
        # a draft model (with windows of its own, or none) reads the same block tables, and a KV transfer moves
        # whole prompts: keep every block for them
        spec = config.speculative_config
        keep_all = (spec is not None and spec.method == "draft_model") or config.kv_role is not None
        window = None if keep_all else self.model_config.kv_window
        self.kv_cache_manager = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching,
                                               window)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size)
        stop_checker = StopChecker(self.output_processor.detokenize_last_token, self.structured_output.grammar_of)
        self.kv_transfers = None if config.kv_role is None else KVTransferManager(
            config, self.kv_cache_manager, self.executor.kv_connector, self.model_config.vocab_size)
        self.scheduler = Scheduler(config, self.kv_cache_manager, stop_checker, self.structured_output,
                                   self.kv_transfers)
        self.beam_searches: dict[str, BeamSearch] = {}
        self.loras: dict[int, LoRARequest] = {}  # the LoRA adapters added (and not removed), by id
        # the model is loaded: this thread gives its OpenMP workers back, so that the thread which steps the engine
        # (this one again, or AsyncLLM's engine thread, or a caller's) is the only one with a pool (inferno/openmp.py)
        release_thread_pool()

    @property
    def model_runner(self):
        """Rank 0's model runner (the only one with one process)."""
        return self.executor.model_runner

    def wait_for_warm_up(self, timeout: float | None = None) -> bool:
        """Block until the background warm-up is over (the engine at full speed), at most `timeout` seconds; True
        if decode steps now run compiled."""
        return self.executor.wait_for_warm_up(timeout)

    def is_healthy(self) -> bool:
        """False once a rank of a multi-process executor has died (or the engine is shut down)."""
        return self.executor.is_healthy()

    def shutdown(self) -> None:
        """Stop the executor's ranks; the engine cannot run steps afterwards."""
        self.structured_output.shutdown()
        self.executor.shutdown()

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

    # LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read the adapter and check it against the model (ValueError if it does not fit); False if an adapter
        with its id was added already."""
        if not self.config.enable_lora:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True (--enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        known = self.loras.get(lora_request.lora_int_id)
        if known is not None:
            if known != lora_request:
                raise ValueError(f"lora_int_id {lora_request.lora_int_id} is adapter {known.lora_name!r} "
                                 f"({known.lora_path}); remove it first or use another id")
            return False
        self.executor.add_lora(lora_request)
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget the adapter; requests already running with it finish with it. False if it was not added."""
        if self.loras.pop(lora_int_id, None) is None:
            return False
        self.executor.remove_lora(lora_int_id)
        return True

    def list_loras(self) -> set[int]:
        return set(self.loras)

    # requests in
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        """`params`: SamplingParams to generate, PoolingParams for the prompt's embedding. `lora_request`: the LoRA
        adapter to run it with (added first if it was not)."""
        if self.output_processor.has_request(request_id) or request_id in self.beam_searches:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None:
            self.add_lora(lora_request)
        if self.config.runner == "pooling" and not isinstance(params, PoolingParams):
            raise ValueError("this model runs with runner='pooling': it computes embeddings (LLM.embed, POST "
                             "/v1/embeddings) and generates no text; start it with runner='generate' for that")
        request = self.input_processor.process(request_id, prompt, params or SamplingParams(), arrival_time)
        text, token_ids, params, arrival_time = (request.prompt, request.prompt_token_ids, request.sampling_params,
                                                 request.arrival_time)
        if isinstance(params, PoolingParams):
            self._add_pooling_request(request_id, text, token_ids, params, arrival_time, lora_request)
            return
        kv = params.kv_transfer_params
        if kv is not None:
            if self.kv_transfers is None:
                raise ValueError("kv_transfer_params was given, but this instance takes no part in disaggregated "
                                 "prefill/decode (start it with --kv-role prefill or decode)")
            self.kv_transfers.check(params, len(token_ids))
        if params.use_beam_search:
            search = BeamSearch(request_id, text, token_ids, params, self.tokenizer.eos_token_ids,
                                self.max_model_len, arrival_time, lora_request)
            self.beam_searches[request_id] = search
            self.scheduler.add_request(search.requests[0])
            return
        state = RequestState(request_id, text, token_ids, params)
        for index in range(params.n):
            child_params = params if params.n == 1 else params.child(index)
            if index > 0:  # the first sample alone scores the prompt, or receives it from a prefill instance
                child_params = replace(child_params, prompt_logprobs=None, kv_transfer_params=None)
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            req = Request(child_id, token_ids, child_params, self.tokenizer.eos_token_ids, self.max_model_len,
                          arrival_time, lora_request=lora_request)
            if index == 0 and kv is not None and kv.is_remote_prefill:
                req.remote_prefill = kv
            state.samples.append(SampleState(index, req, IncrementalDetokenizer(self.tokenizer, child_params)))
            if params.structured_outputs is not None:
                self.structured_output.add_request(child_id, params.structured_outputs)
        self.output_processor.add_request(state)
        leader = state.samples[0].request
        for sample in state.samples:  # the other samples fork the first one's prompt
            self.scheduler.add_request(sample.request, fork_of=None if sample.index == 0 else leader)

    def _add_pooling_request(self, request_id: str, text: str | None, token_ids: list[int], params: PoolingParams,
                             arrival_time: float, lora_request: LoRARequest | None = None) -> None:
        """An embedding request: one prompt-only request, which ends with its pooled vector."""
        req = Request(request_id, token_ids, PROMPT_ONLY, set(), self.max_model_len, arrival_time,
                      pooling_params=params, lora_request=lora_request)
        state = RequestState(request_id, text, token_ids, PROMPT_ONLY)
        state.samples.append(SampleState(0, req, IncrementalDetokenizer(self.tokenizer, PROMPT_ONLY)))
        self.output_processor.add_request(state)
        self.scheduler.add_request(req)

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
                self._finish(sample.request.request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_pending_kv_transfers(self) -> bool:
        """Blocks held for, or being written by, a KV transfer: steps keep polling them."""
        return self.kv_transfers is not None and self.kv_transfers.has_pending

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states) + len(self.beam_searches)

    # one step
    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        failed = self._fail_grammars() + self._finish_kv_transfers()
        sched = self.scheduler.schedule()
        if not sched.num_scheduled_tokens:
            if not failed:
                self._wait_for_work()
            return failed
        try:
            output = self.executor.execute_model(sched)
        except ExecutorDeadError:  # no step can run any more: the engine is done
            self._fail(self._requests_in(sched), "the engine's worker ranks died")
            raise
        except Exception as e:  # one bad step ends the requests in it, not the engine
            logger.exception("model step failed; ending the %d requests in it", len(sched.num_scheduled_tokens))
            return self._fail(self._requests_in(sched), f"{type(e).__name__}: {e}")
        updated = self.scheduler.update_from_output(sched, output)
        beams = [req for req in updated if req.beam_search_id is not None]
        outputs = self._advance_beam_searches(beams, output) if beams else []
        updated = [req for req in updated if req.beam_search_id is None]
        self.output_processor.record_logprobs(output)
        if self.scheduler.spec_policy is not None:
            self._propose_drafts()
        # a token reaches its user when the step returns: after the drafts for the next step (the draft model's
        # prefill of a new prompt counts in its time to first token)
        now = time.time()
        for req in updated:
            if req.request_id in output.sampled_token_ids:
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
                req.metrics.last_token_time = now
            if req.is_finished:  # the scheduler's stop checker decided it, with this step's last token
                req.metrics.finished_time = now
        return failed + outputs + self.output_processor.make_outputs(updated)

    def _propose_drafts(self) -> None:
        """The speculation policy picks who speculates in the next step and how much, from this step's outcome; rank
        0 of the executor proposes the drafts, which the grammars of constrained requests then cut."""
        planned = self.scheduler.spec_policy.plan(self.scheduler.running)
        if not planned:
            return
        trees = self.scheduler.spec_policy.tree_requests(planned, len(self.scheduler.running))
        drafts = self.executor.propose_drafts(self.scheduler.worker_view.draft_requests(planned, trees))
        for req, _ in planned:
            req.spec_token_ids = drafts.spec_token_ids.get(req.request_id, [])
            req.draft_probs = drafts.draft_probs.get(req.request_id)
            req.spec_tree_parents = drafts.spec_tree_parents.get(req.request_id)
        self.structured_output.trim_drafts(self.scheduler.running)

    def _fail_grammars(self) -> list[RequestOutput]:
        """End the requests whose grammar could not be compiled."""
        outputs = []
        for request_id, message in self.structured_output.take_failed().items():
            req = self.scheduler.requests.get(request_id)
            if req is not None:
                outputs += self._fail([req], message)
        return outputs

    def _wait_for_work(self) -> None:
        """Nothing can run until a grammar compiles or a KV transfer ends: wait for one, briefly, rather than spin
        the serving loop (a spinning loop kept a core and the GIL from the threads that move the KV)."""
        if self.structured_output.pending:
            self.structured_output.wait_for_compile(GRAMMAR_POLL_S)
        elif self.has_pending_kv_transfers():
            self.kv_transfers.wait(KV_TRANSFER_POLL_S)

    def _finish_kv_transfers(self) -> list[RequestOutput]:
        """Requests whose pulled KV arrived get their first token (the prefill instance's); failed pulls fall
        back to computing the prompt here, or fail their request."""
        if self.kv_transfers is None:
            return []
        outputs, started = [], []
        for req, error in self.kv_transfers.poll():
            if error is not None and self.config.kv_transfer_fallback == "error":
                outputs += self._fail([req], f"the prompt's KV cache could not be transferred: {error}")
            elif self.scheduler.finish_kv_pull(req, error):
                req.metrics.first_token_time = req.metrics.last_token_time = time.time()
                if req.is_finished:
                    req.metrics.finished_time = req.metrics.first_token_time
                started.append(req)
        return outputs + self.output_processor.make_outputs(started)

    def _requests_in(self, sched: SchedulerOutput) -> list[Request]:
        return [self.scheduler.requests[rid] for rid in sched.num_scheduled_tokens]

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
                self._finish(req.request_id, RequestStatus.FINISHED_ERROR)
                _, sample = self.output_processor.sample_of[req.request_id]
                sample.error = message
                samples.append(req)
        return outputs + self.output_processor.make_outputs(samples)

    def _finish(self, request_id: str, status: RequestStatus) -> None:
        """End a request from outside its tokens (aborted, failed step); tokens end requests in the stop checker."""
        req = self.scheduler.finish_request(request_id, status)
        if req is not None:
            req.metrics.finished_time = time.time()

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
