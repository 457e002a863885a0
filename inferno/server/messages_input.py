"""An Anthropic Messages request as the chat completions request it asks for: system and messages as chat messages
(tool_use blocks -> an assistant's tool_calls, tool_result blocks -> tool messages), tools as functions and
tool_choice in OpenAI's words, so that one path renders, constrains and samples both."""
from typing import Any

from pydantic import ValidationError

from inferno.server.protocol import ChatCompletionRequest, ChatMessage
from inferno.server.protocol_anthropic import (
    ContentBlockParam, CountTokensRequest, MessageParam, MessagesRequest, ToolChoice, ToolParam)
from inferno.server.serving import OpenAIError

SUPPORTED_BLOCKS = "text, tool_use, tool_result, thinking and redacted_thinking"


def unsupported_block(block_type: str, param: str) -> OpenAIError:
    return OpenAIError(f"content blocks of type {block_type!r} are not supported by this server; it reads "
                       f"{SUPPORTED_BLOCKS} blocks", param=param)


def block_text(block: ContentBlockParam, param: str) -> str:
    if block.text is None:
        raise OpenAIError("a text block needs `text`", param=param)
    return block.text


def joined_text(content: str | list[ContentBlockParam] | None, param: str) -> str:
    """Text content: a string, or text blocks joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for block in content:
        if block.type != "text":
            raise unsupported_block(block.type, param)
        texts.append(block_text(block, param))
    return "\n".join(texts)


def tool_message(block: ContentBlockParam, param: str) -> ChatMessage:
    if block.tool_use_id is None:
        raise OpenAIError("a tool_result block needs `tool_use_id`", param=param)
    content = joined_text(block.content, param)
    return ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=f"Error: {content}" if block.is_error
                       else content)


def user_messages(content: list[ContentBlockParam], param: str) -> list[ChatMessage]:
    """A user turn's tool results as tool messages (Anthropic puts them first), then its text as a user message."""
    tools, texts = [], []
    for block in content:
        if block.type == "tool_result":
            tools.append(tool_message(block, param))
        elif block.type == "text":
            texts.append(block_text(block, param))
        else:
            raise unsupported_block(block.type, param)
    return tools + ([ChatMessage(role="user", content="\n".join(texts))] if texts or not tools else [])


def tool_call(block: ContentBlockParam, param: str) -> dict[str, Any]:
    if block.id is None or block.name is None:
        raise OpenAIError("a tool_use block needs `id` and `name`", param=param)
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input or {}}}


def assistant_message(content: list[ContentBlockParam], param: str) -> ChatMessage:
    texts, calls, reasoning = [], [], []
    for block in content:
        if block.type == "text":
            texts.append(block_text(block, param))
        elif block.type == "tool_use":
            calls.append(tool_call(block, param))
        elif block.type == "thinking":
            reasoning.append(block.thinking or "")
        elif block.type != "redacted_thinking":  # encrypted thinking of Anthropic's models: nothing to render
            raise unsupported_block(block.type, param)
    fields = {"tool_calls": calls} if calls else {}
    if reasoning:
        fields["reasoning_content"] = "\n".join(reasoning)
    return ChatMessage(role="assistant", content="\n".join(texts), **fields)


def chat_messages(system: str | list[ContentBlockParam] | None, messages: list[MessageParam]) -> list[ChatMessage]:
    chat = [ChatMessage(role="system", content=joined_text(system, "system"))] if system else []
    for i, message in enumerate(messages):
        param = f"messages.{i}.content"
        if isinstance(message.content, str):
            chat.append(ChatMessage(role=message.role, content=message.content))
        elif message.role == "user":
            chat.extend(user_messages(message.content, param))
        else:
            chat.append(assistant_message(message.content, param))
    return chat


def function_tool(tool: ToolParam) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise OpenAIError(f"tools of type {tool.type!r} (Anthropic's server tools) are not supported; send custom "
                          "tools with `name`, `description` and `input_schema`", param="tools")
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def openai_tool_choice(choice: ToolChoice | None, has_tools: bool) -> str | dict[str, Any] | None:
    if choice is None or (choice.type == "auto" and not has_tools):
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise OpenAIError("tool_choice of type 'tool' needs `name`", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_request_of(request: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completions request that renders the same prompt and samples the same way (max_tokens aside)."""
    fields: dict[str, Any] = {}
    if isinstance(request, MessagesRequest):
        fields = {"temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k,
                  "stop": request.stop_sequences}
    choice = request.tool_choice
    thinking = request.thinking is not None and request.thinking.enabled
    try:
        return ChatCompletionRequest(
            model=request.model, messages=chat_messages(request.system, request.messages),
            tools=[function_tool(t) for t in request.tools] if request.tools else None,
            tool_choice=openai_tool_choice(choice, bool(request.tools)),
            parallel_tool_calls=choice is None or not choice.disable_parallel_tool_use,
            chat_template_kwargs={"enable_thinking": thinking}, **fields)
    except ValidationError as e:
        raise OpenAIError(f"the request does not convert to a chat request: {e}") from e
