"""Anthropic's Messages API bodies (POST /v1/messages and /v1/messages/count_tokens), as pydantic models."""
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # cache_control, citations, ... are ignored


# request
class ContentBlockParam(AnthropicModel):
    """A block of a message's content, of any type; which fields a type needs is checked when it is converted."""
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: "str | list[ContentBlockParam] | None" = None
    is_error: bool = False
    thinking: str | None = None


class MessageParam(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class ToolParam(AnthropicModel):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" or absent; Anthropic's server tools are not served


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(AnthropicModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)  # accepted, not enforced: only max_tokens bounds the reply

    @property
    def enabled(self) -> bool:
        return self.type != "disabled"


class CountTokensRequest(AnthropicModel):
    """What the prompt is made of: system, messages and tools (and thinking, which the chat template may read)."""
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[ContentBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    stream: bool = False


# response
class TextBlock(AnthropicModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(AnthropicModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic signs its thinking so it can check it when sent back; a local model's is not


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class MessageUsage(AnthropicModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(AnthropicModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: str | None = None  # end_turn, max_tokens, stop_sequence, tool_use, model_context_window_exceeded
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(AnthropicModel):
    input_tokens: int


class AnthropicErrorInfo(AnthropicModel):
    type: str
    message: str


class AnthropicErrorResponse(AnthropicModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
