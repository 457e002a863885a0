"""The front door: a prompt (text, token ids or chat messages) plus SamplingParams become a validated engine
request. LLM, the CLI and the HTTP server all come in here; bad input stops here with a ValueError."""
import time
from dataclasses import dataclass, replace
from typing import NotRequired, TypedDict

from inferno.config import ModelConfig
from inferno.loader.tokenizer import Tokenizer
from inferno.pooling_params import PoolingParams
from inferno.sampling_params import SamplingParams
from inferno.structured_output.grammar import check_structured_outputs


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids came from, when there is one (echoed in outputs)


PromptType = str | TextPrompt | TokensPrompt
ChatMessage = dict[str, str]


@dataclass(slots=True)
class EngineRequest:
    """A request that passed every check, ready for the scheduler."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | PoolingParams  # PoolingParams: an embedding request, resolved for the model
    arrival_time: float


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.hidden_size = model_config.hidden_size
        self.pooler = model_config.pooler
        self.max_model_len = max_model_len

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                arrival_time: float | None = None) -> EngineRequest:
        pooling = isinstance(params, PoolingParams)
        if pooling:
            params = self.resolve_pooling(params)
        else:
            self.check_params(params)
        text, token_ids = self.tokenize(prompt)
        self.check_prompt(token_ids, needs_output=not pooling)
        return EngineRequest(request_id, text, token_ids, params, arrival_time or time.time())

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The prompt's text (None when only ids were given) and token ids."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError("prompt must be a string, a TextPrompt {'prompt': text} or a TokensPrompt "
                         "{'prompt_token_ids': [...]}")

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> TokensPrompt:
        """Chat messages through the model's chat template; the template writes the special tokens itself."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tools=tools, **(chat_template_kwargs or {}))
        return TokensPrompt(prompt=text, prompt_token_ids=self.tokenizer.encode(text, add_special_tokens=False))

    def check_prompt(self, token_ids: list[int], needs_output: bool = True) -> None:
        """`needs_output`: a token must be left for the output (an embedding request's prompt may fill the context)."""
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) > self.max_model_len - needs_output:
            left = " (at least one token must be left for the output)" if needs_output else ""
            raise ValueError(f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}{left}")
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is out of range for vocabulary size {self.vocab_size}")

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: values measured against this model's vocabulary."""
        bad = next((t for t in params.stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids contains {bad}, outside the vocabulary (size {self.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary size {self.vocab_size}, got {value}")
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs)

    def resolve_pooling(self, params: PoolingParams) -> PoolingParams:
        """The request's pooling with the model's defaults filled in; `dimensions` only where the model was trained
        for truncated (Matryoshka) embeddings."""
        dimensions, allowed = params.dimensions, self.pooler.matryoshka_dimensions
        if dimensions is not None:
            if allowed is None:
                raise ValueError("dimensions is not supported by this model: it was not trained for truncated "
                                 "(Matryoshka) embeddings")
            if dimensions > self.hidden_size or (allowed and dimensions not in allowed):
                raise ValueError(f"dimensions must be one of {allowed or f'1..{self.hidden_size}'}, got {dimensions}")
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        return replace(params, normalize=normalize, pooling_type=self.pooler.pooling_type)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None, param: str = "max_tokens") -> None:
        """The OpenAI server's rule: prompt and completion together must fit max_model_len (offline, a long
        max_tokens is cut to what fits instead)."""
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
                f"completion). Please reduce the length of the prompt or of {param}.")
