"""Text Generation Inference (TGI) request and response shapes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

U64_MAX = 2**64 - 1


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateParameters(Strict):
    best_of: int | None = Field(None, ge=1, description="not available yet (issue 4)")
    decoder_input_details: bool = Field(
        False, description="details.prefill: the prompt's tokens and their logprobs (not with streaming)"
    )
    details: bool = Field(False, description="return finish reason, tokens and their logprobs")
    do_sample: bool = Field(False, description="sample instead of greedy decoding")
    extra: dict[str, Any] | None = Field(
        None, description="Ember extension: third-party logits processors by name, each with its parameters"
    )
    frequency_penalty: float | None = Field(
        None, ge=-2.0, le=2.0, description="subtract penalty x count of each token generated so far (OpenAI semantics)"
    )
    grammar: dict[str, Any] | None = Field(
        None, description='{"type": "json", "value": JSON schema} or {"type": "regex", "value": pattern}'
    )
    max_new_tokens: int | None = Field(None, ge=1, description="default: what --max-total-tokens leaves")
    repetition_penalty: float | None = Field(
        None, gt=0.0, description="> 0; 1.0 is none; divides (or multiplies, if negative) the logits of seen tokens"
    )
    return_full_text: bool | None = Field(False, description="prepend the prompt to generated_text")
    seed: int | None = Field(None, ge=0, le=U64_MAX)
    stop: list[str] = Field(default_factory=list, description="stop sequences (at most --max-stop-sequences)")
    temperature: float | None = Field(None, gt=0.0, description="> 0; implies sampling")
    top_k: int | None = Field(None, gt=0)
    top_n_tokens: int | None = Field(
        None, ge=0, le=5, description="details.top_tokens: the N most likely tokens at each step (at most 5, as TGI)"
    )
    top_p: float | None = Field(None, gt=0.0, lt=1.0)
    truncate: int | None = Field(None, ge=1, description="keep only the last N prompt tokens")
    typical_p: float | None = Field(None, gt=0.0, lt=1.0, description="locally typical sampling mass; implies sampling")
    watermark: bool = Field(
        False, description="watermark the output (Kirchenbauer et al.); the server's gamma and delta, "
        "or extra.watermark's; detect with POST /watermark/detect"
    )
    adapter_id: str | None = Field(None, description="a loaded LoRA adapter's name (LORA_ADAPTERS, --lora-modules, "
                                   "POST /v1/load_lora_adapter; another name is a 404); null or the served "
                                   "model's name: the base model")
    priority: int = Field(
        0, ge=-(2**31), le=2**31 - 1,
        description="Ember extension: lower runs first and is preempted last; equal priorities are first come, first served",
    )


class GenerateRequest(Strict):
    inputs: str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)


class CompatGenerateRequest(GenerateRequest):
    stream: bool = False


class TokenizeRequest(Strict):
    inputs: str
    parameters: GenerateParameters | None = None


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool


class SequenceDetails(BaseModel):
    """What TGI reports of one generated sequence."""

    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None
    prefill: list[Token] = Field(default_factory=list)
    tokens: list[Token]
    top_tokens: list[list[Token]] = Field(default_factory=list)


class BestOfSequence(SequenceDetails):
    generated_text: str


class Details(SequenceDetails):
    best_of_sequences: list[BestOfSequence] | None = None


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None
    input_length: int


class StreamResponse(BaseModel):
    index: int
    token: Token
    top_tokens: list[Token] | None = None
    generated_text: str | None = None
    details: StreamDetails | None = None


class SimpleToken(BaseModel):
    id: int
    text: str
    start: int
    stop: int


class ErrorResponse(BaseModel):
    error: str
    error_type: str


class Info(BaseModel):
    model_id: str
    model_sha: str | None = None
    model_dtype: str
    model_device_type: str
    model_pipeline_tag: str = "text-generation"
    max_concurrent_requests: int
    max_best_of: int = 1
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_client_batch_size: int = 1
    router: str = "ember"
    version: str
    backend: str
    num_kv_blocks: int
    kv_block_size: int
    kv_cache_tokens: int
    prefix_caching: bool
    prefix_cache_hit_rate: float
    chunked_prefill: bool
    # speculative decoding: method, proposed / accepted / emitted tokens, acceptance rate,
    # mean accepted length (null when off)
    speculation: dict | None = None
