"""OpenAI request and response shapes: /v1/completions and /v1/chat/completions.

Requests are validated strictly (`parse_model`): unknown fields are refused, no
"5" for 5; `null` stands for the default. Fields Ember does not implement yet are accepted only at their neutral
value; the routes answer 422 naming the field and the issue that brings it.

Structured outputs (docs/api.md): OpenAI's `response_format`, vLLM's `guided_*` fields
and their newer `structured_outputs` object, on both routes; tools on chat.
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


class JsonSchemaFormat(Strict):
    name: str = Field(max_length=64, description="the schema's name (accepted and echoed nowhere)")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema the answer follows")
    strict: bool | None = Field(None, description="accepted: the answer always follows the schema")
    description: str | None = Field(None, description="accepted and ignored")


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description='with type "json_schema"')


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: one of these constrains the answer."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (object or its text)")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="an EBNF (GBNF) or Lark grammar")
    json_object: bool | None = Field(None, description="any JSON object")


class SamplingFields(Strict):
    """What both routes share."""

    model: str = Field(max_length=512, description="the served model's name (the base model) or a loaded LoRA "
                       "adapter's (GET /v1/models lists them; another name is a 404); with adapters off any name is "
                       "the base model; echoed back")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy decoding")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16, description="completions per prompt; they share the prompt's KV blocks")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with `stream: true`")
    stop: str | list[str] | None = Field(None, description="up to --max-stop-sequences strings; the text ends before them")
    seed: int | None = Field(None, ge=I64_MIN, le=U64_MAX, description="same seed, same request: same text")
    presence_penalty: float | None = Field(
        None, ge=-2.0, le=2.0, description="subtracted once from the logit of every token generated so far"
    )
    frequency_penalty: float | None = Field(
        None, ge=-2.0, le=2.0, description="subtracted from a token's logit once per time it was generated"
    )
    logit_bias: dict[str, float] | None = Field(
        None, description='token id (a string key, as JSON has them) -> bias in [-100, 100] added to its logit'
    )
    user: str | None = Field(None, description="accepted and ignored")
    # Beyond OpenAI's API, as vLLM accepts them (the openai SDK sends them through `extra_body`):
    top_k: int | None = Field(None, ge=-1, description="extension: keep the k most likely tokens; -1 or 0 disables")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="extension: drop tokens below min_p x the top probability")
    repetition_penalty: float | None = Field(
        None, gt=0.0, description="extension: transformers' repetition penalty over prompt and output; 1 is none"
    )
    min_tokens: int | None = Field(None, ge=0, description="extension: no EOS or stop token before this many tokens")
    bad_words: list[str] | None = Field(
        None, max_length=64, description="extension: words never generated (each as tokenized with and without a leading space)"
    )
    stop_token_ids: list[int] | None = Field(None, max_length=64, description="extension: token ids that end generation")
    ignore_eos: bool | None = Field(None, description="extension: do not stop at EOS")
    extra: dict[str, Any] | None = Field(
        None, description="extension: third-party logits processors by name, each with its parameters"
    )
    watermark: bool | None = Field(
        None, description="extension: watermark the output (as TGI's parameter); gamma/delta via extra.watermark"
    )
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1, description="extension (as vLLM): lower runs first and is preempted last; equal priorities are first come, first served")
    response_format: ResponseFormat | None = Field(None, description="text, any JSON object, or a JSON schema")
    # vLLM's structured outputs (extra_body): at most one constraint per request
    guided_json: dict[str, Any] | str | None = Field(None, description="extension: a JSON schema the answer follows")
    guided_regex: str | None = Field(None, description="extension: a regular expression the whole answer matches")
    guided_choice: list[str] | None = Field(None, description="extension: the answer is one of these strings")
    guided_grammar: str | None = Field(None, description="extension: an EBNF (GBNF) or Lark grammar")
    guided_decoding_backend: str | None = Field(None, description="extension: the grammar backend (outlines, xgrammar)")
    structured_outputs: StructuredOutputs | None = Field(None, description="extension: vLLM's newer form of guided_*")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isascii() or not key.isdigit():
                raise PydanticCustomError(
                    "logit_bias_key", "keys must be token ids (non-negative integers), got {key}", {"key": repr(key)}
                )
            if not -100.0 <= bias <= 100.0:
                raise PydanticCustomError(
                    "logit_bias_value", "biases must be in [-100, 100], got {bias} for token {key}",
                    {"bias": bias, "key": key},
                )
        return value

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop(cls, value: Any, handler: Any) -> Any:
        return _one_of(value, handler, "a string, a list of strings, or null")

    @property
    def has_structured_output(self) -> bool:
        """Whether any structured-output field is set (plain requests skip that code)."""
        rf = self.response_format
        return (rf is not None and rf.type != "text") or any(value is not None for value in (
            self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar,
            self.guided_decoding_backend, self.structured_outputs,
        ))

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
    logprobs: int | None = Field(
        None, ge=0, le=5, description="per generated token its logprob and the N most likely tokens (choices[].logprobs)"
    )
    best_of: int | None = Field(None, ge=1, le=16, description="sample this many, return the n with the highest cumulative logprob (not with stream)")
    suffix: str | None = Field(None, description="not available yet")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: Any) -> Any:
        return _one_of(value, handler, "a string, a list of strings, a list of token ids, or a list of token-id lists")


class TextContentPart(BaseModel):
    """`{"type": "text", "text": ...}` or `{"type": "image_url", "image_url": {"url", "detail"}}`
    (a model that takes images: docs/multimodal.md); other part types are refused by name (422)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    # checked by the route (a 400 naming the part): a model's processor decides what `detail` does
    image_url: Any = Field(None, description='with type "image_url": {"url": a data: URL, or an http(s):// or '
                           'file:// URL the server allows, "detail": "auto" | "low" | "high"}')


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="`developer` is treated as `system`; `tool` carries a tool's result"
    )
    content: str | list[TextContentPart] | None = Field(
        None, description="a string, or a list of text parts (joined by newlines) and image_url parts; may be null "
        "beside tool_calls"
    )
    name: str | None = Field(None, description="accepted and ignored")
    tool_calls: list[dict[str, Any]] | None = Field(None, description="an assistant message's calls")
    tool_call_id: str | None = Field(None, description="a tool message's call")

    @field_validator("content", mode="wrap")
    @classmethod
    def _content(cls, value: Any, handler: Any) -> Any:
        return _one_of(value, handler, 'a string or a list of content part objects ("text", "image_url")')


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated name of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="default: what --max-total-tokens leaves")
    logprobs: bool | None = Field(None, description="return each generated token's logprob (choices[].logprobs.content)")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: the N most likely tokens at each position")
    tools: list[dict[str, Any]] | None = Field(None, description='function tools: {"type": "function", "function": {...}}')
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"none", "auto" (default with tools), "required", or {"type": "function", "function": {"name"}}'
    )
    parallel_tool_calls: bool | None = Field(None, description="with required: one call or a list of them (default true)")
    store: bool | None = Field(None, description="accepted and ignored: Ember stores nothing")
    metadata: dict[str, str] | None = Field(None, description="accepted and ignored")


# -- responses ---------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = Field(
        None, description="with --reasoning-parser: the reasoning before the answer (absent without one)"
    )


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


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
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="pieces of calls: index, then id, type and function.name first, function.arguments in pieces"
    )
    reasoning_content: str | None = Field(None, description="with --reasoning-parser: a piece of the reasoning")


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class LoadLoRAAdapterRequest(Strict):
    """vLLM's POST /v1/load_lora_adapter (with --enable-lora-runtime-updates)."""

    lora_name: str = Field(min_length=1, max_length=200, description="the name requests select it by (`model`, "
                           "`adapter_id`): no spaces, not a loaded adapter's or the served model's")
    lora_path: str = Field(min_length=1, max_length=4096, description="a directory holding adapter_config.json and "
                           "adapter_model.safetensors (PEFT's), or a Hub id (org/name)")


class UnloadLoRAAdapterRequest(Strict):
    """vLLM's POST /v1/unload_lora_adapter: requests running under it finish, new ones get 404."""

    lora_name: str = Field(min_length=1, max_length=200, description="a loaded adapter's name")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
