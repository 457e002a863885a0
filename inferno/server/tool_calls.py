"""The request side of tool calling: checking `tools` / `tool_choice`, the tools the chat template sees, and the
constraint that makes tool_choice "required" or a named function hold (constrained decoding on the functions'
parameter schemas)."""
from typing import Any

from inferno.sampling_params import StructuredOutputsParams
from inferno.server.serving import OpenAIError
from inferno.server.tool_parsers import NamedToolParser, RequiredToolParser, TOOL_PARSERS, ToolParser

ANY_OBJECT = {"type": "object"}


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function") if tool.get("type", "function") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise OpenAIError("each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}",
                          param="tools")
    return function


def named_function(tool_choice: str | dict[str, Any] | None) -> str | None:
    """The function name of tool_choice {"type": "function", "function": {"name": ...}}, None for the strings."""
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return None
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise OpenAIError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                          "{'name': ...}}", param="tool_choice")
    return name


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> dict[str, dict]:
    """Functions by name; 400 for a malformed tool, a tool_choice without tools, or an unknown function."""
    functions = {f["name"]: f for f in map(function_of, tools or [])}
    name = named_function(tool_choice)
    if tool_choice not in (None, "none") and not functions:
        raise OpenAIError("tool_choice needs tools", param="tool_choice")
    if name is not None and name not in functions:
        raise OpenAIError(f"tool_choice names function {name!r}, which is not among the tools "
                          f"{sorted(functions)}", param="tool_choice")
    return functions


def tools_for_template(tools: list[dict[str, Any]] | None, tool_choice) -> list[dict[str, Any]] | None:
    """tool_choice "none" keeps the tools out of the prompt."""
    return None if tool_choice == "none" else tools


def tool_constraint(functions: dict[str, dict], tool_choice, parallel_tool_calls: bool) -> StructuredOutputsParams | None:
    """tool_choice "required": a JSON array of calls to the tools; a named function: its arguments."""
    name = named_function(tool_choice)
    if name is not None:
        return StructuredOutputsParams(json=functions[name].get("parameters") or ANY_OBJECT)
    if tool_choice != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": n}, "parameters": f.get("parameters") or ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False} for n, f in functions.items()]
    array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel_tool_calls:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array)


def tool_parser(tool_choice, template_parser: str | None) -> ToolParser | None:
    """How the reply is read: the constrained formats for required / named, else the template's parser (auto)."""
    name = named_function(tool_choice)
    if name is not None:
        return NamedToolParser(name)
    if tool_choice == "required":
        return RequiredToolParser()
    if tool_choice == "none" or template_parser is None:
        return None
    return TOOL_PARSERS[template_parser]()
