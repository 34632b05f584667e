"""OpenAI's /v1/embeddings request and response shapes (strict, like the other OpenAI routes)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from ember.api.schemas.openai import Strict, _one_of


class EmbeddingRequest(Strict):
    model: str = Field(max_length=512, description="the served model's name (echoed as the served name)")
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, token ids, or a list of token-id lists (one embedding each)"
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: a list of numbers; base64: the little-endian float32 bytes, base64-encoded"
    )
    dimensions: int | None = Field(
        None, ge=1, description="keep the first N components, then re-normalise (Matryoshka models only; else 400)"
    )
    user: str | None = Field(None, max_length=512, description="accepted and ignored")

    @field_validator("input", mode="wrap")
    @classmethod
    def _input(cls, value: Any, handler: Any) -> Any:
        return _one_of(value, handler, "a string, a list of strings, a list of token ids, or a list of token-id lists")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
