"""Turns the engine's per-step progress into RequestOutputs: text deltas, logprobs, n > 1 grouping."""
from dataclasses import dataclass, field

import torch

from inferno.engine.detokenizer import IncrementalDetokenizer
from inferno.core.scheduler_output import ModelRunnerOutput
from inferno.loader.tokenizer import Tokenizer
from inferno.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, PositionLogprobs,
                             RequestOutput)
from inferno.request import Request
from inferno.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class SampleState:
    """One of the n samples of a request."""
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    num_sent_chars: int = 0  # DELTA mode: text and tokens already handed out
    num_sent_tokens: int = 0
    finished: bool = False
    error: str | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.sample_of: dict[str, tuple[RequestState, SampleState]] = {}  # child request id -> its sample

    def add_request(self, state: RequestState) -> None:
        self.states[state.request_id] = state
        for sample in state.samples:
            self.sample_of[sample.request.request_id] = (state, sample)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states

    def record_logprobs(self, output: ModelRunnerOutput) -> None:
        for rid, (ids, values, rank) in output.logprobs.items():
            self.sample_of[rid][1].request.logprobs.append(self._position(ids, values, rank))
        for rid, positions in output.prompt_logprobs.items():
            req = self.sample_of[rid][1].request
            req.prompt_logprobs.extend(self._position(*p) for p in positions)

    def _position(self, ids: list[int], values: list[float], rank: int) -> PositionLogprobs:
        """The chosen token (first) with its rank, then the top-k by rank."""
        position = {ids[0]: Logprob(values[0], rank, self.tokenizer.id_to_token(ids[0]))}
        for r, (token_id, value) in enumerate(zip(ids[1:], values[1:]), start=1):
            position.setdefault(token_id, Logprob(value, r, self.tokenizer.id_to_token(token_id)))
        return position

    def detokenize_last_token(self, req: Request) -> str | None:
        """Feed a request's newest token to its detokenizer; returns the stop string the text now ends with."""
        _, sample = self.sample_of[req.request_id]
        return sample.detokenizer.update([req.token_ids[-1]])

    def make_outputs(self, touched: list[Request]) -> list[RequestOutput | PoolingRequestOutput]:
        """RequestOutputs for the requests whose samples changed this step (finished states are dropped)."""
        touched_states: dict[str, RequestState] = {}
        for req in touched:
            state, sample = self.sample_of[req.request_id]
            sample.finished = req.is_finished
            touched_states[state.request_id] = state
        touched_ids = {req.request_id for req in touched}
        outputs = []
        for state in touched_states.values():
            output = self._request_output(state, touched_ids)
            if output is not None:
                outputs.append(output)
            if state.finished:
                self.states.pop(state.request_id)
                for s in state.samples:
                    self.sample_of.pop(s.request.request_id)
        return outputs

    def _request_output(self, state: RequestState,
                        touched_ids: set[str]) -> RequestOutput | PoolingRequestOutput | None:
        if state.samples[0].request.pooling_params is not None:
            return self._pooling_output(state)
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = [c for s in state.samples if not delta or s.request.request_id in touched_ids
                       if (c := self._completion(s, delta)) is not None]
        first = state.samples[0].request
        prompt_logprobs = first.prompt_logprobs if state.params.prompt_logprobs is not None else None
        errors = [s.error for s in state.samples if s.error]
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs, outputs=completions, finished=state.finished,
            metrics=first.metrics, error=errors[0] if errors else None, kv_transfer_params=first.kv_transfer_params)

    @staticmethod
    def _pooling_output(state: RequestState) -> PoolingRequestOutput | None:
        """An embedding request's one output: its vector, or its error."""
        sample = state.samples[0]
        if not state.finished:
            return None
        req = sample.request
        data = req.pooled if req.pooled is not None else torch.empty(0)
        return PoolingRequestOutput(state.request_id, PoolingOutput(data), state.prompt_token_ids, True,
                                    state.prompt, req.metrics, sample.error)

    def _completion(self, s: SampleState, delta: bool) -> CompletionOutput | None:
        req = s.request
        text = s.detokenizer.visible_text(req.is_finished)
        token_ids = req.output_token_ids
        logprobs = req.logprobs if req.sampling_params.logprobs is not None else None
        cumulative = sum(p[t].logprob for p, t in zip(req.logprobs, token_ids)) if logprobs is not None else None
        if delta:
            if len(text) == s.num_sent_chars and len(token_ids) == s.num_sent_tokens and not req.is_finished:
                return None
            text, token_ids, logprobs = (text[s.num_sent_chars:], token_ids[s.num_sent_tokens:],
                                         logprobs[s.num_sent_tokens:] if logprobs is not None else None)
            s.num_sent_chars += len(text)
            s.num_sent_tokens += len(token_ids)
        return CompletionOutput(index=s.index, text=text, token_ids=list(token_ids), cumulative_logprob=cumulative,
                                logprobs=logprobs, finish_reason=req.finish_reason, stop_reason=req.stop_reason)
