"""The context of one HTTP request: its id, trace, outcome and engine requests.

The middleware creates a `RequestContext` per request and makes it current (a
context variable, so the route, its stream and the tasks they start all see the
same object); routes and the service write into it (an error, each engine
request's timings), and the middleware reads it at the end for metrics, the span
tree and the access log.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI's logging imports this module; torch only where a request is served
    from ember.outputs import RequestOutput

CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection first"


@dataclass(slots=True)
class GenerationRecord:
    """One engine request behind an HTTP request (a list prompt has several)."""

    num_prompt_tokens: int
    num_samples: int = 1
    start_time: float = field(default_factory=time.time)  # handed to the engine
    end_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    finish_reasons: tuple[str | None, ...] = ()
    is_finished: bool = False
    error_type: str | None = None
    detokenize_times: dict[int, float] = field(default_factory=dict)  # by sample

    @property
    def detokenize_time(self) -> float:
        return sum(self.detokenize_times.values())

    def observe(self, out: RequestOutput) -> None:
        """Fold in one output (of any sample, for n > 1)."""
        metrics = out.metrics
        if metrics is not None:
            self.first_scheduled_time = _earliest(self.first_scheduled_time, metrics.first_scheduled_time)
            self.first_token_time = _earliest(self.first_token_time, metrics.first_token_time)
            if metrics.last_token_time is not None:
                self.last_token_time = max(self.last_token_time or 0.0, metrics.last_token_time)
            self.num_cached_tokens = max(self.num_cached_tokens, metrics.num_cached_tokens)
            self.detokenize_times[out.index] = metrics.detokenize_time
        self.num_generated_tokens += len(out.new_token_ids)  # the step's tokens, cumulative or delta outputs
        self.finish_reasons = tuple(c.finish_reason for c in out.outputs)
        self.is_finished = out.finished

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return max(0.0, self.first_scheduled_time - self.start_time)

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return max(0.0, self.first_token_time - self.start_time)

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between generated tokens, for one-sample requests with two or more."""
        if self.num_samples != 1 or self.num_generated_tokens < 2 or self.first_token_time is None:
            return None
        return max(0.0, (self.last_token_time or self.first_token_time) - self.first_token_time) / (
            self.num_generated_tokens - 1
        )


def _earliest(current: float | None, new: float | None) -> float | None:
    if new is None:
        return current
    return new if current is None else min(current, new)


@dataclass(slots=True)
class RequestContext:
    request_id: str
    route: str  # the route's path, or "other" (a bounded label value)
    method: str
    start_time: float = field(default_factory=time.time)
    trace_id: str | None = None  # 32 hex digits, when the request belongs to a trace
    trace_context: Any = None  # the OpenTelemetry context whose span is this request's
    status: int | None = None
    error_status: int | None = None
    error_type: str | None = None
    generations: list[GenerationRecord] = field(default_factory=list)

    def note_error(self, status: int, error_type: str) -> None:
        """The first error wins: later ones (a stream's own end) are consequences."""
        if self.error_type is None:
            self.error_status = status
            self.error_type = error_type

    @property
    def outcome(self) -> str:
        """success, client_error, server_error or cancelled (the client left, or a stream was cut)."""
        if self.error_type is not None:
            if self.error_status == CLIENT_CLOSED:
                return "cancelled"
            return "client_error" if (self.error_status or 500) < 500 else "server_error"
        status = self.status or 500
        if status == CLIENT_CLOSED:
            return "cancelled"
        if status >= 500:
            return "server_error"
        if status >= 400:
            return "client_error"
        if any(not g.is_finished for g in self.generations):
            return "cancelled"
        return "success"

    @property
    def num_prompt_tokens(self) -> int:
        return sum(g.num_prompt_tokens for g in self.generations)

    @property
    def num_generated_tokens(self) -> int:
        return sum(g.num_generated_tokens for g in self.generations)


_current: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("ember_request", default=None)


def current() -> RequestContext | None:
    """The context of the HTTP request being served, or None (outside a request)."""
    return _current.get()


def activate(ctx: RequestContext) -> contextvars.Token:
    return _current.set(ctx)


def deactivate(token: contextvars.Token) -> None:
    _current.reset(token)
