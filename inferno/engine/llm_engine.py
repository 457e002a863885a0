"""LLMEngine: requests in, RequestOutputs out, one scheduled step at a time."""
import logging
import time
from dataclasses import replace

import torch

from inferno.config import EngineConfig
from inferno.engine.kv_cache_manager import KVCacheManager
from inferno.engine.output_processor import OutputProcessor, RequestState, SampleState
from inferno.engine.detokenizer import IncrementalDetokenizer
from inferno.engine.scheduler import Scheduler
from inferno.loader.model_loader import load_model
from inferno.outputs import RequestOutput
from inferno.request import Request, RequestStatus
from inferno.sampling_params import SamplingParams
from inferno.worker.model_runner import ModelRunner, kv_bytes_per_block

logger = logging.getLogger("inferno")

PromptType = str | dict | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        loaded = load_model(config.model, config.torch_dtype, config.quantization, config.quantization_group_size)
        self.model_path = loaded.path
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        num_blocks = config.kv_cache_memory // kv_bytes_per_block(loaded.config, config.block_size, config.torch_dtype,
                                                                  config.kv_cache_dtype)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes is too small for one KV block")
        self.num_blocks = num_blocks
        self.max_model_len = self._max_model_len(num_blocks * config.block_size)
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.kv_cache_manager)
        self.model_runner = ModelRunner(loaded.model, config, num_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, **kwargs) -> "LLMEngine":
        return cls(EngineConfig(**kwargs))

    def _max_model_len(self, cache_tokens: int) -> int:
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
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_params(params)
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids)
        arrival_time = arrival_time or time.time()
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
        for sample in state.samples:
            self.scheduler.add_request(sample.request)

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            state = self.output_processor.states.pop(rid, None)
            if state is None:
                continue
            for sample in state.samples:
                self.output_processor.sample_of.pop(sample.request.request_id, None)
                self.scheduler.finish_request(sample.request.request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    # one step
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.requests:
            return []
        try:
            output = self.model_runner.execute_model(sched)
        except Exception as e:  # one bad step ends the requests in it, not the engine
            logger.exception("model step failed; ending the %d requests in it", len(sched.requests))
            return self._fail(sched.requests, f"{type(e).__name__}: {e}")
        updated = self.scheduler.update_from_output(sched, output)
        self.output_processor.record_logprobs(output)
        for req in updated:
            stop = self.output_processor.detokenize(req)
            if stop is not None:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        return self.output_processor.make_outputs(updated)

    def _fail(self, requests: list[Request], message: str) -> list[RequestOutput]:
        for req in requests:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
            _, sample = self.output_processor.sample_of[req.request_id]
            sample.error = message
        return self.output_processor.make_outputs(requests)

    # stats
    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage
