"""What the engine hands back to callers, shaped like vLLM's outputs."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ember.logprobs import Logprob


@dataclass(slots=True)
class RequestMetrics:
    """When a request reached each stage; ``None`` until it did."""

    arrival_time: float = field(default_factory=time.time)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # prompt tokens found in the prefix cache when the request was first scheduled
    num_cached_tokens: int = 0
    # seconds spent detokenizing its tokens and matching stop strings, in total
    detokenize_time: float = 0.0



class OutputKind(enum.Enum):
    """What a request's outputs hold: everything so far (CUMULATIVE: offline use,
    final answers) or only what each step added (DELTA: streaming, O(n) per stream)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence. `text` is the concatenation of every streamed delta."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    # the stop token id or stop string that ended generation, if any
    stop_reason: int | str | None = None
    # log-probability of each generated token under the distribution it was sampled from
    token_logprobs: list[float] = field(default_factory=list)
    # with SamplingParams.logprobs: per generated token, {token id: Logprob}, the
    # chosen token first, then the top alternatives by rank; None when not asked
    logprobs: list[dict[int, Logprob]] | None = None
    # the seed this sequence was sampled with (a parallel-sampling child's own: seed + i)
    seed: int | None = None
    # finish reason "error": why this sequence ended (e.g. its grammar could not be compiled)
    error: str | None = None
    # `LLM.chat` with tools: the calls the answer holds (ember.plugin.tool_parser.ToolCall), read
    # from `text`; None when the chat had no tools
    tool_calls: tuple | None = None

    @property
    def cumulative_logprob(self) -> float:
        return float(sum(self.token_logprobs))


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step.

    `new_token_ids` and `new_text` are what this step added (for streaming);
    `outputs[0]` holds everything so far.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    # with SamplingParams.prompt_logprobs: per prompt token, as CompletionOutput.logprobs
    # (the first is None: nothing precedes it); None when not asked
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # which completion this step's new_token_ids / new_text belong to (n > 1)
    index: int = 0
    # best_of > n, in the final output: the candidates not chosen, best first (the n
    # chosen are `outputs`, best first; SamplingParams.best_of_ranking decides)
    candidates: list[CompletionOutput] | None = None
    # the request's timings as of this output (a copy: the engine keeps updating its own)
    metrics: RequestMetrics | None = None
    # a pooling request's vector (SamplingParams.pooling; float32 values), on its final
    # output; None for a generating request
    pooled: list[float] | None = None


@dataclass(slots=True)
class PoolingOutput:
    """What `LLM.embed` / `EngineClient.pool` return for one prompt (vLLM's
    ``EmbeddingRequestOutput``): the pooled vector (``PoolingParams.pooling_type``
    ``"logits"``: the requested tokens' logits)."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]  # float32 values

    @property
    def data(self) -> torch.Tensor:
        """The vector as a float32 tensor ``(dimensions,)``."""
        return torch.tensor(self.embedding, dtype=torch.float32)

    @classmethod
    def from_request_output(cls, output: RequestOutput) -> PoolingOutput:
        if output.pooled is None:
            raise ValueError(f"request {output.request_id!r} is not a finished pooling request")
        return cls(output.request_id, output.prompt_token_ids, output.pooled)
