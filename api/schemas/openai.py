"""OpenAI request and response shapes: /v1/completions and /v1/chat/completions.

Requests are validated strictly (`parse_model`): unknown fields are refused, no
"5" for 5; `null` stands for the default. Fields Ember does not implement yet are accepted only at their neutral
value; the routes answer 422 naming the field and the issue that brings it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

I64_MIN = -(2**63)
U64_MAX = 2**64 - 1


class Strict(BaseModel):
    """Unknown fields are refused; `null` for an optional field means its default, as
    in OpenAI's API (clients send `"stop": null`, `"n": null`)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


def _one_of(value: Any, handler: Any, expected: str) -> Any:
    """Run the union's validation; replace pydantic's per-member errors with one line."""
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("union_type", "must be {expected}", {"expected": expected}) from None


class StreamOptions(Strict):
    include_usage: bool = Field(False, description="send a last chunk with `usage` and no choices")


class SamplingFields(Strict):
    """What both routes share."""

    model: str = Field(description="echoed back; any name is accepted (one model is served)")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy decoding")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, description="only 1 for now (issue 4)")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with `stream: true`")
    stop: str | list[str] | None = Field(None, description="up to --max-stop-sequences strings; the text ends before them")
    seed: int | None = Field(None, ge=I64_MIN, le=U64_MAX, description="same seed, same request: same text")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="only 0 for now (issue 4)")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="only 0 for now (issue 4)")
    logit_bias: dict[str, float] | None = Field(None, description="only empty for now (issue 4)")
    user: str | None = Field(None, description="accepted and ignored")

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop(cls, value: Any, handler: Any) -> Any:
        return _one_of(value, handler, "a string, a list of strings, or null")

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, token ids, or a list of token-id lists (one choice each)"
    )
    max_tokens: int | None = Field(16, ge=1, description="default 16")
    echo: bool = Field(False, description="prepend the prompt to the text")
    logprobs: int | None = Field(None, ge=0, le=5, description="not available yet (issue 4)")
    best_of: int | None = Field(None, ge=1, description="only 1 for now (issue 4)")
    suffix: str | None = Field(None, description="not available yet")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: Any) -> Any:
        return _one_of(value, handler, "a string, a list of strings, a list of token ids, or a list of token-id lists")


class TextContentPart(BaseModel):
    """`{"type": "text", "text": ...}`; other part types are refused by name (422)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"] = Field(description="`developer` is treated as `system`")
    content: str | list[TextContentPart] = Field(description="a string, or a list of text parts (joined by newlines)")
    name: str | None = Field(None, description="accepted and ignored")

    @field_validator("content", mode="wrap")
    @classmethod
    def _content(cls, value: Any, handler: Any) -> Any:
        return _one_of(value, handler, 'a string or a list of {"type": "text", "text": ...} parts')


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated name of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="default: what --max-total-tokens leaves")
    logprobs: bool | None = Field(None, description="not available yet (issue 4)")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="not available yet (issue 4)")
    response_format: ResponseFormat | None = Field(None, description='only {"type": "text"} for now')
    tools: list[dict[str, Any]] | None = Field(None, description="not available yet")
    tool_choice: str | dict[str, Any] | None = Field(None, description='only "none" for now')
    parallel_tool_calls: bool | None = Field(None, description="accepted and ignored (no tools yet)")
    store: bool | None = Field(None, description="accepted and ignored: Ember stores nothing")
    metadata: dict[str, str] | None = Field(None, description="accepted and ignored")


# -- responses ---------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    """Also the shape of each streamed chunk (`usage` null but on the last, optional one)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
