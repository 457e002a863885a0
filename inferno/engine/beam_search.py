"""Beam search inside the batched engine, scored like HF transformers' `generate(num_beams=...)`.

Each live beam is a request in the scheduler's running batch. When every beam of a search has its next-token
log-probabilities, the search keeps the best continuations: a beam that continues with several tokens is forked
(the children share its KV blocks; the partial last block is copied when written), beams that are not continued
are freed. Scores follow HF: the sum of log-softmax values; a finished hypothesis scores
sum / generated_length ** length_penalty; `early_stopping` True / False / "never" as in HF.
"""
import time
from dataclasses import dataclass, field

from inferno.engine.scheduler import Scheduler
from inferno.loader.tokenizer import Tokenizer
from inferno.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inferno.lora_request import LoRARequest
from inferno.request import Request, RequestStatus
from inferno.sampling_params import SamplingParams


@dataclass
class Beam:
    request: Request
    score: float  # sum of the log-probabilities of its generated tokens


@dataclass(order=True)
class Hypothesis:
    score: float  # length-penalised
    token_ids: list[int] = field(compare=False)
    cumulative_logprob: float = field(compare=False)


class BeamSearch:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int], max_model_len: int, arrival_time: float,
                 lora_request: LoRARequest | None = None):
        self.request_id = request_id
        self.lora_request = lora_request
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.width = params.n
        self.eos_token_ids = set() if params.ignore_eos else eos_token_ids | set(params.stop_token_ids)
        self.max_tokens = min(params.max_tokens or max_model_len, max_model_len - len(prompt_token_ids))
        # as HF: enough candidates that `width` of them continue even if the best ones all end in EOS
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * self.width
        self.beam_params = SamplingParams(temperature=0.0, max_tokens=None, logprobs=self.num_candidates)
        self.max_model_len = max_model_len
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_beams_created = 0
        self.beams = [Beam(self._new_request(prompt_token_ids), 0.0)]
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.improvable = True  # HF's early-stop heuristic still allows a better hypothesis
        self.reports: dict[str, tuple[list[int], list[float]]] = {}
        self.error: str | None = None

    @property
    def requests(self) -> list[Request]:
        return [beam.request for beam in self.beams]

    def _new_request(self, token_ids: list[int]) -> Request:
        request = Request(f"{self.request_id}-beam{self.num_beams_created}", self.prompt_token_ids, self.beam_params,
                          set(), self.max_model_len, self.metrics.arrival_time,
                          beam_search_id=self.request_id, lora_request=self.lora_request)
        request.token_ids = list(token_ids)
        self.num_beams_created += 1
        return request

    def record(self, request: Request, logprobs: tuple[list[int], list[float], int]) -> None:
        """A beam's next-token log-probabilities: the sampled token first, then the top candidates."""
        ids, values, _ = logprobs
        self.reports[request.request_id] = (ids[1:], values[1:])

    @property
    def ready(self) -> bool:
        """Every live beam has computed its last token and reported (a preempted beam recomputes first)."""
        return all(b.request.request_id in self.reports and b.request.num_computed_tokens == b.request.num_tokens
                   for b in self.beams)

    def advance(self, scheduler: Scheduler) -> bool:
        """One step of the search; returns True when it is over (its requests are then all freed)."""
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.time()
        generated = self.beams[0].request.num_output_tokens + 1  # tokens per sequence after this step
        candidates = sorted(((beam.score + value, i, token)
                             for i, beam in enumerate(self.beams)
                             for token, value in zip(*self.reports[beam.request.request_id])),
                            key=lambda c: c[0], reverse=True)[:self.num_candidates]
        self.reports.clear()
        last_step = generated >= self.max_tokens
        ends = [last_step or token in self.eos_token_ids for _, _, token in candidates]
        # only the top `width` candidates may finish a hypothesis (HF), and only while that can still help
        full = len(self.finished) == self.width and self.params.early_stopping is True
        if self.improvable and not full:
            for (score, i, token), end in zip(candidates[:self.width], ends):
                if end:
                    tokens = self.beams[i].request.output_token_ids + [token]
                    self.finished.append(Hypothesis(score / generated ** self.params.length_penalty, tokens, score))
            self.finished = sorted(self.finished, reverse=True)[:self.width]
        continuing = [c for c, end in zip(candidates, ends) if not end][:self.width]
        self._fork(scheduler, continuing)
        done = not continuing or not self._still_improvable(generated) or (
            len(self.finished) == self.width and self.params.early_stopping is True)
        if done:
            self.finish(scheduler, RequestStatus.FINISHED_STOPPED)
        return done

    def _still_improvable(self, generated: int) -> bool:
        """HF's heuristic: once `width` hypotheses exist, can the best live beam still beat the worst of them?"""
        if self.improvable and len(self.finished) == self.width:
            penalty = self.params.length_penalty
            length = self.max_tokens if self.params.early_stopping == "never" and penalty > 0 else generated
            self.improvable = self.beams[0].score / length ** penalty > self.finished[-1].score
        return self.improvable

    def _fork(self, scheduler: Scheduler, continuing: list[tuple[float, int, int]]) -> None:
        """The next beams: a parent continued once keeps its request, more continuations fork it."""
        next_beams, continued = [], set()
        for score, i, token in continuing:
            parent = self.beams[i].request
            if i in continued:
                child = self._new_request(parent.token_ids)
                scheduler.fork_request(parent, child)
            else:
                child = parent
                continued.add(i)
            next_beams.append(Beam(child, score))
        for i, beam in enumerate(self.beams):
            if i not in continued:
                scheduler.finish_request(beam.request.request_id, RequestStatus.FINISHED_STOPPED)
        for beam, (_, _, token) in zip(next_beams, continuing):
            beam.request.append_token(token)
        self.beams = next_beams

    def finish(self, scheduler: Scheduler, status: RequestStatus) -> None:
        for beam in self.beams:
            scheduler.finish_request(beam.request.request_id, status)
        self.beams = []
        self.metrics.finished_time = time.time()

    def output(self, tokenizer: Tokenizer) -> RequestOutput:
        completions = []
        for index, hyp in enumerate(self.finished):
            stopped = bool(hyp.token_ids) and hyp.token_ids[-1] in self.eos_token_ids
            text_ids = hyp.token_ids[:-1] if stopped else hyp.token_ids
            completions.append(CompletionOutput(
                index=index, text=tokenizer.decode(text_ids, skip_special_tokens=self.params.skip_special_tokens),
                token_ids=list(hyp.token_ids), cumulative_logprob=hyp.cumulative_logprob, logprobs=None,
                finish_reason="stop" if stopped else "length"))
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             prompt_logprobs=None, outputs=completions, finished=True, metrics=self.metrics,
                             error=self.error)
