"""What a request is constrained to: llguidance's grammar text for StructuredOutputsParams, checked at the front
door, and the matcher that follows one request's output token by token."""
import json

import llguidance

from inferno.sampling_params import StructuredOutputsParams

MAX_GRAMMAR_CHARS = 256 << 10  # a schema, regex or grammar longer than this is refused at the front door
# JSON comes out on one line with json.dumps' separators: no free whitespace for a small model to loop on
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's resource limits (its defaults, with a smaller grammar): a grammar over them fails to compile
PARSER_LIMITS = dict(max_grammar_size=200_000)


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**PARSER_LIMITS)


def grammar_spec(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for the request's constraint (not yet checked)."""
    if params.json is not None or params.json_object:
        schema = params.json if params.json is not None else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs json is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured_outputs json must be a JSON schema object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    if params.regex is not None:
        return llguidance.grammar_from("regex", params.regex)
    if params.choice is not None:
        return llguidance.grammar_from("choice", params.choice)
    return llguidance.grammar_from("grammar", params.grammar)


def cache_key(params: StructuredOutputsParams) -> str:
    """Requests with equal keys share one compiled grammar."""
    if params.json is not None:
        schema = params.json if isinstance(params.json, str) else json.dumps(params.json, sort_keys=True)
        return f"json:{schema}"
    if params.json_object:
        return "json_object"
    if params.regex is not None:
        return f"regex:{params.regex}"
    if params.choice is not None:
        return f"choice:{json.dumps(params.choice)}"
    return f"grammar:{params.grammar}"


def check_structured_outputs(params: StructuredOutputsParams) -> str:
    """The grammar text, once llguidance accepts it (without a tokenizer: cheap); ValueError says what is wrong."""
    size = len(cache_key(params))
    if size > MAX_GRAMMAR_CHARS:
        raise ValueError(f"structured_outputs is {size} characters long; at most {MAX_GRAMMAR_CHARS} are allowed")
    try:
        spec = grammar_spec(params)
    except ValueError as e:
        raise ValueError(f"structured_outputs is invalid: {e}") from e
    error = llguidance.LLMatcher.validate_grammar(spec, limits=parser_limits())
    if error:
        raise ValueError(f"structured_outputs is invalid: {error.strip()}")
    return spec


class Grammar:
    """One request's position in its grammar: the tokens it may sample next, advanced by each accepted token."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return self.matcher.consume_token(token_id)

    def num_valid_tokens(self, token_ids: list[int]) -> int:
        """How many leading `token_ids` the grammar allows from here (draft tokens)."""
        return self.matcher.validate_tokens(token_ids)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: nothing but end-of-sequence may follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()
