"""Anthropic Messages API shapes: POST /v1/messages and /v1/messages/count_tokens.

Requests are validated strictly (unknown fields refused, no "5" for 5). Fields of the
Messages API that Ember cannot honour (`mcp_servers`, `container`, document blocks,
image blocks for a model that takes no images, server tools; `thinking` without a
reasoning parser) are named by a 400 (`UNSUPPORTED_FIELDS`), never ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ember.api.schemas.openai import _one_of

# top-level fields of Anthropic's API that Ember refuses by name (a 400 saying why)
UNSUPPORTED_FIELDS = {
    "mcp_servers": "MCP servers",
    "container": "code-execution containers",
    "context_management": "context management",
    "service_tier": "service tiers",
    "output_config": "output configuration (effort, structured output formats)",
    "output_format": "structured output formats",
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = Field(None, description="accepted and ignored")
    citations: None = Field(None, description="only null")


class ImageBlock(Strict):
    """A user message's image (a model that takes images: docs/multimodal.md); its
    source is checked by its type (`Base64ImageSource`, `URLImageSource`)."""

    type: Literal["image"]
    source: dict[str, Any] = Field(description='{"type": "base64", "media_type", "data"} or {"type": "url", "url"}')
    cache_control: dict[str, Any] | None = Field(None, description="accepted and ignored")


class Base64ImageSource(Strict):
    type: Literal["base64"]
    media_type: str = Field(description="image/jpeg, image/png, image/gif or image/webp")
    data: str = Field(description="the image file, base64")


class URLImageSource(Strict):
    type: Literal["url"]
    url: str = Field(description="an http(s):// URL the server allows (--allowed-media-domains), or file://")


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = Field(None, description="accepted and ignored")


class ThinkingBlock(Strict):
    """An earlier answer's thinking, sent back: accepted and left out of the prompt (as
    Anthropic's API leaves earlier turns' thinking out of the context)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = Field(None, description="accepted and ignored (Ember signs nothing)")


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] = ""
    is_error: bool | None = Field(None, description="an error result: the text is prefixed with `Error: `")
    cache_control: dict[str, Any] | None = Field(None, description="accepted and ignored")


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]] = Field(
        description="a string, or a list of `text`, `tool_use` (assistant), `tool_result` and `image` (user) blocks"
    )

    @field_validator("content", mode="wrap")
    @classmethod
    def _content(cls, value: Any, handler: Any) -> Any:
        return _one_of(value, handler, "a string or a list of content block objects")


class System(Strict):
    system: str | list[TextBlock] | None = None

    @field_validator("system", mode="wrap")
    @classmethod
    def _system(cls, value: Any, handler: Any) -> Any:
        return _one_of(value, handler, 'a string or a list of {"type": "text", "text": ...} blocks')


class Tool(Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="a JSON schema object: the tool's input")
    type: Literal["custom"] | None = Field(None, description="only custom (client) tools; server tools are refused")
    cache_control: dict[str, Any] | None = Field(None, description="accepted and ignored")


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description='with type "tool": the tool to call')
    disable_parallel_tool_use: bool | None = Field(None, description="at most one tool call")


class Thinking(Strict):
    """Extended thinking: with ``ember serve --reasoning-parser``, the model's reasoning as
    ``thinking`` blocks (``enabled``) or left out of the answer (``disabled``)."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(
        None, ge=1024, description='with "enabled", required as by Anthropic (>= 1024, < max_tokens): the '
        "reasoning's end tag is forced once it has this many tokens (docs/api.md)")


class CountTokensRequest(System):
    model: str = Field(max_length=512, description="the served model's name or a loaded LoRA adapter's")
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = Field(None, description="only with --reasoning-parser (else a 400)")


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, description="required: the most tokens to generate")
    stop_sequences: list[str] | None = Field(None, description="up to --max-stop-sequences non-empty strings")
    temperature: float | None = Field(None, ge=0.0, le=1.0, description="default 1.0; 0 is greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="0: off")
    stream: bool | None = None
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")
    cache_control: dict[str, Any] | None = Field(None, description="accepted and ignored (prefix caching is automatic)")


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]] = Field(description="`thinking`, `text` and `tool_use` blocks")
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorDetail
