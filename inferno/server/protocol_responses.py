"""OpenAI's Responses API bodies (POST /v1/responses): the request, input and output items, the response object.

Input and output items are the same models: a response's output, passed back as input (or kept in the store for
`previous_response_id`), renders the same way."""
import time
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from inferno.server.protocol import OpenAIModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class InputText(OpenAIModel):
    type: Literal["input_text"]
    text: str


class OutputText(OpenAIModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class Refusal(OpenAIModel):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    status: ItemStatus | None = None


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"] = "function_call"
    id: str | None = None
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus | None = None


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: str | list[InputText]
    status: ItemStatus | None = None


class SummaryText(OpenAIModel):
    type: Literal["summary_text"]
    text: str


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIModel):
    type: Literal["reasoning"] = "reasoning"
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None


def item_type(item: Any) -> str | None:
    """An input item's `type`; a message may leave it out (OpenAI's "easy input message")."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(item_type)]
OutputItem = Annotated[MessageItem | FunctionCallItem | ReasoningItem, Field(discriminator="type")]


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(OpenAIModel):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | ToolChoiceFunction


class TextFormat(OpenAIModel):
    model_config = ConfigDict(serialize_by_alias=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def json_schema_has_a_schema(self) -> "TextFormat":
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a format of type json_schema needs a schema")
        return self


class TextConfig(OpenAIModel):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(OpenAIModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


Metadata = dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]]


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(None, ge=1)
    reasoning: ReasoningConfig | None = None
    metadata: Metadata | None = Field(None, max_length=16)
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    stream: bool = False
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIModel):
    reason: Literal["max_output_tokens"]


class ResponseError(OpenAIModel):
    code: Literal["server_error"] = "server_error"
    message: str


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class ResponsesResponse(OpenAIModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    metadata: Metadata | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    temperature: float
    tool_choice: ToolChoice
    tools: list[FunctionTool]
    top_p: float
    max_output_tokens: int | None
    previous_response_id: str | None
    reasoning: ReasoningConfig | None
    store: bool
    text: TextConfig
    truncation: Literal["auto", "disabled"]
    usage: ResponseUsage | None = None
    user: str | None
    background: bool = False


class DeletedResponse(OpenAIModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
