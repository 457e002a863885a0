"""Counts derived from a request's token ids, shared by the engine's `Request` and the worker's record of it."""


class TokenCounts:
    """Mixin over `prompt_token_ids` and `token_ids` (prompt + output)."""
    __slots__ = ()
    prompt_token_ids: list[int]
    token_ids: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]
