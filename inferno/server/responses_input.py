"""A Responses request as the chat completion request it amounts to: instructions and input items become chat
messages (function calls as an assistant turn's tool_calls, their outputs as tool turns, reasoning as the
assistant's reasoning_content), tools and text.format take chat's shapes. Chat's checks, template and grammars then
serve both routes."""
from contextlib import contextmanager

from inferno.server.protocol import ChatCompletionRequest, ChatMessage, ResponseFormat
from inferno.server.protocol_responses import (
    FunctionCallItem, FunctionCallOutputItem, FunctionTool, InputItem, MessageItem, ResponsesRequest, TextFormat,
    ToolChoice)
from inferno.server.serving import OpenAIError

# chat's parameter names in errors, as the Responses API calls them
RESPONSES_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text",
                    "structured_outputs": "text"}


def input_items(input: str | list[InputItem]) -> list[InputItem]:
    return [MessageItem(role="user", content=input)] if isinstance(input, str) else input


def chat_request(request: ResponsesRequest, conversation: list[InputItem]) -> ChatCompletionRequest:
    """`conversation`: the stored history of previous_response_id, then this request's input items."""
    messages = chat_messages(request.instructions, conversation)
    if not messages:
        raise OpenAIError("input must not be empty", param="input")
    return ChatCompletionRequest(
        model=request.model, messages=messages, temperature=request.temperature, top_p=request.top_p,
        max_completion_tokens=request.max_output_tokens, tools=[chat_tool(t) for t in request.tools] or None,
        tool_choice=chat_tool_choice(request.tool_choice, bool(request.tools)),
        parallel_tool_calls=request.parallel_tool_calls, response_format=response_format(request.text.format),
        stream=request.stream, user=request.user)


def chat_messages(instructions: str | None, items: list[InputItem]) -> list[ChatMessage]:
    """Reasoning, text and function calls of one reply (in that order) make one assistant turn."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    function_names: dict[str, str] = {}  # call_id -> name, for templates that name a tool turn's function
    for item in items:
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if isinstance(item, MessageItem) and item.role == "assistant":
            if last is not None and not last["content"] and "tool_calls" not in last:
                last["content"] = text_of(item.content)
            else:
                messages.append({"role": "assistant", "content": text_of(item.content)})
        elif isinstance(item, MessageItem):
            # chat templates know "system"; "developer" is OpenAI's newer name for it
            messages.append({"role": "system" if item.role == "developer" else item.role,
                             "content": text_of(item.content)})
        elif isinstance(item, FunctionCallItem):
            function_names[item.call_id] = item.name
            if last is None:
                messages.append(last := {"role": "assistant", "content": ""})
            function = {"name": item.name, "arguments": item.arguments}
            last.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": function})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "name": function_names.get(item.call_id),
                             "content": text_of(item.output)})
        elif reasoning := "\n".join(part.text for part in item.content or item.summary):
            messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
    return [ChatMessage(**{k: v for k, v in m.items() if v is not None}) for m in messages]


def text_of(content: str | list) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part.refusal if part.type == "refusal" else part.text for part in content)


def chat_tool(tool: FunctionTool) -> dict:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def chat_tool_choice(tool_choice: ToolChoice, has_tools: bool) -> str | dict | None:
    if isinstance(tool_choice, str):  # Responses' default "auto" needs no tools; chat's tool_choice does
        return None if tool_choice == "auto" and not has_tools else tool_choice
    return {"type": "function", "function": {"name": tool_choice.name}}


def response_format(format: TextFormat) -> ResponseFormat | None:
    if format.type == "text":
        return None
    if format.type == "json_object":
        return ResponseFormat(type="json_object")
    json_schema = {"name": format.name or "response", "schema": format.schema_, "strict": format.strict}
    return ResponseFormat.model_validate({"type": "json_schema", "json_schema": json_schema})


@contextmanager
def responses_params():
    """OpenAIErrors raised by chat's machinery, with the parameter named as the Responses request names it."""
    try:
        yield
    except OpenAIError as error:
        if error.info.param in RESPONSES_PARAMS:
            error.info.param = RESPONSES_PARAMS[error.info.param]
        error.info.message = error.info.message.replace("max_completion_tokens", "max_output_tokens")
        raise

