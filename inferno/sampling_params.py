"""Sampling parameters with vLLM's names, defaults and validation."""
from dataclasses import dataclass, field, replace
from enum import Enum

from inferno.core.kv_transfer import KVTransferParams


@dataclass
class StructuredOutputsParams:
    """vLLM's constrained decoding options: exactly one of json (a JSON schema, as a dict or its text), regex,
    choice (one of these strings), grammar (Lark or GBNF) or json_object (any JSON object)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: compact separators, no optional whitespace

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar or "
                             f"json_object, got {given or 'none'}")
        if self.choice is not None and not (isinstance(self.choice, list)
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs choice must be a list of non-empty strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs {name} must be a string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs json must be a JSON schema: a dict or its JSON text")


class RequestOutputKind(Enum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # beam search (HF transformers' semantics): n beams, all returned best first; sampling knobs are ignored
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (JSON schema, regex, ...)
    kv_transfer_params: KVTransferParams | None = None  # disaggregated prefill/decode (core/kv_transfer.py)
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValueError(f"{name} {message}, got {getattr(self, name)!r}")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        check(self.temperature >= 0.0, "temperature", "must be non-negative")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be -1 (disable), 0 or a positive integer")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "must be greater than zero")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              "max_tokens", "must be at least 1")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be non-negative")
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
              "logprobs", "must be non-negative")
        check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
              "prompt_logprobs", "must be non-negative")
        check(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**64), "seed",
              "must be an integer in [-2**63, 2**64)")
        check(all(isinstance(s, str) and s for s in self.stop_strings), "stop", "must be non-empty strings")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative integers")
        check(self.early_stopping in (True, False, "never"), "early_stopping", "must be true, false or 'never'")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be a StructuredOutputsParams")
        if self.use_beam_search:
            unsupported = {"logprobs": self.logprobs is not None, "prompt_logprobs": self.prompt_logprobs is not None,
                           "stop": bool(self.stop_strings), "min_tokens": self.min_tokens > 0,
                           "presence_penalty": self.presence_penalty != 0.0,
                           "frequency_penalty": self.frequency_penalty != 0.0,
                           "repetition_penalty": self.repetition_penalty != 1.0,
                           "structured_outputs": self.structured_outputs is not None}
            for name, used in unsupported.items():
                check(not used, name, "is not supported with use_beam_search")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def child(self, index: int) -> "SamplingParams":
        """Parameters for sample `index` of an n > 1 request (seed offset so samples differ)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
