"""OpenAI's embeddings request and response bodies (plus vLLM's `normalize`), as pydantic models."""
import time
from typing import Literal

from pydantic import Field

from inferno.server.protocol import OpenAIModel, TokenId


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # Matryoshka models only
    user: str | None = None
    normalize: bool | None = None  # vLLM's: None follows the model's pooler config


class EmbeddingData(OpenAIModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the little-endian float32 bytes


class EmbeddingUsage(OpenAIModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
