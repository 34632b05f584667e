"""Rerank (Jina's and Cohere's /v1/rerank, /rerank) and score (vLLM's /v1/score) shapes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from ember.api.schemas.openai import Strict, _one_of


class RerankDocument(Strict):
    text: str


class RerankRequest(Strict):
    model: str | None = Field(None, max_length=512, description="the served model's name (optional)")
    query: str = Field(description="what the documents are ranked against")
    documents: list[str | RerankDocument] = Field(description='strings, or objects {"text": ...}')
    top_n: int | None = Field(None, ge=1, description="return only the N best (default: all)")
    return_documents: bool = Field(True, description="echo each document in its result")

    @field_validator("documents", mode="wrap")
    @classmethod
    def _documents(cls, value: Any, handler: Any) -> Any:
        return _one_of(value, handler, 'a list of strings or of {"text": ...} objects')


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ScoreRequest(Strict):
    model: str | None = Field(None, max_length=512, description="the served model's name (optional)")
    text_1: str | list[str] = Field(description="one text (scored against each of text_2), or a list as long as text_2")
    text_2: str | list[str] = Field(description="one text or a list")

    @field_validator("text_1", "text_2", mode="wrap")
    @classmethod
    def _texts(cls, value: Any, handler: Any) -> Any:
        return _one_of(value, handler, "a string or a list of strings")


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: RerankUsage
