"""OpenAI's request and response bodies (plus vLLM's extra sampling fields), as pydantic models."""
import time
from dataclasses import fields
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from inferno.core.kv_transfer import KVTransferParams
from inferno.sampling_params import SamplingParams, StructuredOutputsParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_N = 128
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1

TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


STRUCTURED_OUTPUTS_KEYS = {f.name for f in fields(StructuredOutputsParams)}


class KVTransferParamsModel(OpenAIModel):
    """vLLM's `kv_transfer_params` (disaggregated prefill and decode; see inferno/core/kv_transfer.py)."""
    model_config = ConfigDict(extra="forbid")
    do_remote_decode: bool = False
    remote_host: str | None = None
    remote_port: int | None = Field(None, ge=1, le=65535)
    transfer_id: int | None = Field(None, ge=0, le=INT64_MAX)
    num_prompt_tokens: int | None = Field(None, ge=1)
    first_token_id: TokenId | None = None


class SamplingRequest(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    use_beam_search: bool = False  # n beams, all returned best first; sampling fields are ignored
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar or json_object
    kv_transfer_params: KVTransferParamsModel | None = None  # from `inferno proxy` to prefill and decode instances

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The constraint asked for by `structured_outputs` or `response_format` (ValueError when malformed)."""
        if self.structured_outputs is not None:
            if self.response_format is not None and self.response_format.type != "text":
                raise ValueError("structured_outputs and response_format cannot be used together")
            unknown = sorted(set(self.structured_outputs) - STRUCTURED_OUTPUTS_KEYS)
            if unknown:
                raise ValueError(f"structured_outputs has unknown keys {unknown}; known keys are "
                                 f"{sorted(STRUCTURED_OUTPUTS_KEYS)}")
            return StructuredOutputsParams(**self.structured_outputs)
        format = self.response_format
        if format is None or format.type == "text":
            return None
        if format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if format.json_schema is None or format.json_schema.schema_ is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return StructuredOutputsParams(json=format.json_schema.schema_)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty, early_stopping=self.early_stopping,
            structured_outputs=structured_outputs or self.structured_outputs_params(),
            kv_transfer_params=None if self.kv_transfer_params is None
            else KVTransferParams(**self.kv_transfer_params.model_dump()))


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A message as the chat template sees it; fields beyond role and content are passed through."""
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's: where the prompt's KV waits


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's: where the prompt's KV waits


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "inferno"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(OpenAIModel):  # vLLM's /v1/load_lora_adapter
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str
    lora_int_id: int | None = None


class TokenizeCompletionRequest(OpenAIModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIModel):
    prompt: str
