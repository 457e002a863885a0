"""Reasoning parsers (`--reasoning-parser`): the text a model writes inside <think>...</think> becomes
`reasoning_content`, the rest `content`. Like the tool parsers, a parse of the text so far only grows as the text
grows (a tag that may still be forming is held back), so streamed deltas add up to the non-streamed message."""
from inferno.server.tool_parsers import held_back

THINK_START, THINK_END = "<think>", "</think>"


class ThinkReasoningParser:
    """`deepseek_r1`: the template opens <think> itself, so the reply starts inside it (a leading <think> is
    dropped); `qwen3`: only a reply that starts with <think> reasons."""

    def __init__(self, starts_in_reasoning: bool):
        self.starts_in_reasoning = starts_in_reasoning

    def parse(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far."""
        stripped = text.lstrip()
        if not final and stripped and THINK_START.startswith(stripped) and stripped != THINK_START:
            return "", ""
        if stripped.startswith(THINK_START):
            text = stripped[len(THINK_START):]
        elif not self.starts_in_reasoning:
            return "", text
        end = text.find(THINK_END)
        if end == -1:
            return (text if final else text[:len(text) - held_back(text, THINK_END)]), ""
        return text[:end], text[end + len(THINK_END):].lstrip("\n")


REASONING_PARSERS = {"deepseek_r1": True, "qwen3": False}  # name -> starts inside reasoning


def reasoning_parser(name: str | None) -> ThinkReasoningParser | None:
    return None if name is None else ThinkReasoningParser(REASONING_PARSERS[name])
