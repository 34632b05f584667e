"""OpenAI Responses API shapes: POST /v1/responses, GET/DELETE /v1/responses/{id}.

Requests are validated strictly (unknown fields refused, no "5" for 5, `null` is the
default). Fields of the Responses API that Ember cannot honour (built-in tools,
`background`, `conversation`, `prompt` templates, `include` values, `reasoning`
settings) are named by a 400 (`UNSUPPORTED_FIELDS`, and the route's checks), never
ignored. Input items are checked one by one (`ember.api.routes.responses_items`), so
that a malformed one is a 400 naming it (`input[2].call_id`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ember.api.schemas.openai import I64_MIN, U64_MAX, Strict, StructuredOutputs, _one_of

# top-level fields of OpenAI's Responses API that Ember refuses by name (a 400 saying why),
# whatever their value but null
UNSUPPORTED_FIELDS = {
    "conversation": "server-side conversations (use `previous_response_id`)",
    "prompt": "stored prompt templates",
    "context_management": "context management (compaction)",
    "moderation": "moderation",
    "image": "image settings",
    "access_programs": "access programs",
    "background_options": "background responses",
    "prompt_cache_options": "prompt-cache options (prefix caching is automatic)",
    "max_tool_calls": "a limit on built-in tool calls",
    "top_logprobs": "logprobs in Responses output",
}

# the `tools[].type` values of OpenAI's built-in (hosted) tools, refused by name
BUILT_IN_TOOLS = (
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "computer", "computer_use", "computer_use_preview", "mcp", "image_generation",
    "local_shell", "shell", "apply_patch", "custom", "tool_search", "namespace",
)


class FunctionTool(Strict):
    """Responses' flat function tool (chat's has the same fields under `function`)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema object: the function's arguments")
    strict: bool | None = Field(None, description="accepted: a forced call always follows the schema")


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64, description='with "json_schema": the schema\'s name')
    schema_: dict[str, Any] | None = Field(None, alias="schema", description='with "json_schema": the JSON schema')
    description: str | None = Field(None, description="accepted and ignored")
    strict: bool | None = Field(None, description="accepted: the answer always follows the schema")


class TextConfig(Strict):
    format: TextFormat | None = Field(None, description="text (default), any JSON object, or a JSON schema")
    verbosity: Literal["medium"] | None = Field(None, description='only "medium" (Ember cannot steer verbosity)')


class Reasoning(Strict):
    """Only null values: a model's reasoning (with --reasoning-parser) cannot be steered or summarised."""

    effort: None = Field(None, description="refused: Ember cannot set how much a model reasons")
    summary: None = Field(None, description="refused: Ember does not summarise reasoning (the reasoning item holds "
                          "the whole text as `content`)")
    generate_summary: None = None


class StreamOptions(Strict):
    include_obfuscation: bool | None = Field(None, description="accepted: Ember's events carry no obfuscation field")


class ResponsesRequest(Strict):
    model: str = Field(max_length=512, description="the served model's name (the base model) or a loaded LoRA "
                       "adapter's; with adapters off any name is the base model; echoed back")
    input: str | list[dict[str, Any]] = Field(description="a string (one user message) or a list of items: messages, "
                                              "`function_call`, `function_call_output` (and `reasoning`, skipped)")
    instructions: str | None = Field(None, description="a system message before the input (not carried over by "
                                     "`previous_response_id`)")
    previous_response_id: str | None = Field(None, max_length=256, description="continue a stored response")
    store: bool = Field(True, description="keep the response for GET and `previous_response_id` (bounded: "
                        "--responses-store-size, --responses-store-ttl)")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with `stream: true`")
    tools: list[dict[str, Any]] | None = Field(None, description='function tools {"type": "function", "name", '
                                               '"parameters", "strict"}; built-in tools are refused')
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"none", "auto" (default with tools), "required", or {"type": "function", "name"}')
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default true)")
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, description="default: what --max-total-tokens leaves")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="default 1; 0 is greedy decoding")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    truncation: Literal["disabled"] | None = Field(None, description='only "disabled": a conversation that does not '
                                                   "fit is a 422, never cut")
    reasoning: Reasoning | None = Field(None, description="only null fields")
    background: Literal[False] | None = Field(None, description="only false: Ember has no background mode")
    include: list[str] | None = Field(None, max_length=0, description="only empty: Ember fills no optional output")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="up to 16 string pairs, echoed back")
    user: str | None = Field(None, max_length=512, description="accepted and echoed")
    safety_identifier: str | None = Field(None, max_length=512, description="accepted and ignored")
    prompt_cache_key: str | None = Field(None, max_length=512, description="accepted and ignored (prefix caching "
                                         "is automatic)")
    prompt_cache_retention: Literal["in_memory"] | None = Field(None, description='only "in_memory"')
    service_tier: Literal["auto", "default"] | None = Field(None, description='only "auto" or "default"')
    # Beyond OpenAI's API, as on the chat route (the openai SDK sends them through `extra_body`):
    seed: int | None = Field(None, ge=I64_MIN, le=U64_MAX, description="extension: same seed, same request: same text")
    top_k: int | None = Field(None, ge=-1, description="extension: keep the k most likely tokens; -1 or 0 disables")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="extension: drop tokens below min_p x the top "
                                "probability")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="extension")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="extension")
    repetition_penalty: float | None = Field(None, gt=0.0, description="extension: 1 is none")
    stop: str | list[str] | None = Field(None, description="extension: up to --max-stop-sequences strings")
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1, description="extension: lower runs first")
    guided_json: dict[str, Any] | str | None = Field(None, description="extension: a JSON schema the answer follows")
    guided_regex: str | None = Field(None, description="extension: a regular expression the whole answer matches")
    guided_choice: list[str] | None = Field(None, description="extension: the answer is one of these strings")
    guided_grammar: str | None = Field(None, description="extension: an EBNF (GBNF) or Lark grammar")
    guided_decoding_backend: str | None = Field(None, description="extension: the grammar backend")
    structured_outputs: StructuredOutputs | None = Field(None, description="extension: vLLM's form of guided_*")

    @field_validator("input", mode="wrap")
    @classmethod
    def _input(cls, value: Any, handler: Any) -> Any:
        return _one_of(value, handler, "a string or a list of input item objects")

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop(cls, value: Any, handler: Any) -> Any:
        return _one_of(value, handler, "a string, a list of strings, or null")


# -- input items (checked one by one by the route) -------------------------------------


class Item(BaseModel):
    """Fields an item carries back from an earlier response (ids, status) are accepted."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text", "refusal", "text"]
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = Field(None, description="accepted and ignored")
    logprobs: list[Any] | None = Field(None, description="accepted and ignored")
    parsed: Any = Field(None, description="accepted and ignored (the openai SDK's parsed output text)")


class ImagePart(BaseModel):
    """An image in an input message (a model that takes images: docs/multimodal.md)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["input_image"]
    image_url: str | None = Field(None, description="a data: URL, or an http(s):// or file:// URL the server allows")
    file_id: str | None = Field(None, description="not supported (Ember has no files API): a 400")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted (the model's processor decides)")


class MessageItem(Item):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]
    phase: Literal["commentary", "final_answer"] | None = None

    @field_validator("content", mode="wrap")
    @classmethod
    def _content(cls, value: Any, handler: Any) -> Any:
        return _one_of(value, handler, "a string or a list of content part objects")


class FunctionCallItem(Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=128)
    arguments: str = Field(description="the arguments object as JSON text")
    parsed_arguments: Any = Field(None, description="accepted and ignored (the openai SDK's parsed output items "
                                  "carry it when sent back as input)")


class FunctionCallOutputItem(Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[TextPart]


class ReasoningItem(Item):
    """A reasoning item sent back: skipped (chat templates drop earlier turns' reasoning)."""

    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


# -- the response (for the OpenAPI document; the route writes the same fields) ----------


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens found in the prefix cache")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="tokens of the reasoning text (with --reasoning-parser)")


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    error: dict[str, Any] | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    model: str
    output: list[dict[str, Any]] = Field(description="`reasoning`, `message` (`output_text` parts) and "
                                         "`function_call` items")
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    text: dict[str, Any]
    usage: ResponseUsage | None
    metadata: dict[str, str]


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool
