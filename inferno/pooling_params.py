"""Pooling parameters of an embedding request, with vLLM's names."""
from dataclasses import dataclass


@dataclass
class PoolingParams:
    """`dimensions`: keep the first this many values of the embedding, then normalize (Matryoshka models only).
    `normalize`: L2-normalize the embedding; None: as the model's pooler config says. `pooling_type` is the
    model's ("LAST" | "MEAN" | "CLS"), filled in by the engine's input processor."""
    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: str | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether the request looks its prompt up in the prefix cache and leaves its blocks there: last-token
        pooling only. MEAN and CLS read the hidden states of positions a hit would skip (vLLM turns prefix caching
        off for them); their K/V is then read by no one once the prompt is computed."""
        return self.pooling_type == "LAST"
