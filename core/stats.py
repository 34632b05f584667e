"""Timings the engine records for observers (metrics, tracing) without depending on them.

`RequestMetrics` rides on each `Request` and is copied into every `RequestOutput`;
`StepStats` describes one engine step. Times are ``time.time()`` seconds (wall clock,
so that they can be placed on a trace); step durations use ``time.perf_counter()``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.scheduler import RequestUpdate, ScheduledItem


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

    def copy(self) -> RequestMetrics:
        return RequestMetrics(
            self.arrival_time, self.first_scheduled_time, self.first_token_time, self.last_token_time,
            self.finished_time, self.num_cached_tokens, self.detokenize_time,
        )


@dataclass(frozen=True, slots=True)
class StepStats:
    """One engine step: how long schedule + forward + sample took, and what it computed."""

    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_requests: int
    num_decode_requests: int

    @property
    def kind(self) -> str:
        """``prefill``, ``decode`` or ``mixed`` (a step holding both); ``empty`` if neither."""
        if self.num_prefill_tokens and self.num_decode_tokens:
            return "mixed"
        if self.num_prefill_tokens:
            return "prefill"
        return "decode" if self.num_decode_tokens else "empty"


def record_step(scheduled: list[ScheduledItem], updates: list[RequestUpdate], started_at: float) -> StepStats:
    """Stamp the requests of one step (first scheduled, tokens, finished) and describe the step.

    ``started_at`` is the ``time.perf_counter()`` taken before the step was scheduled.
    """
    duration = time.perf_counter() - started_at
    now = time.time()
    num_prefill_tokens = num_decode_tokens = num_prefill = num_decode = 0
    for item in scheduled:
        metrics = item.request.metrics
        if metrics.first_scheduled_time is None:
            # the step began `duration` ago; the request was scheduled then
            metrics.first_scheduled_time = now - duration
            metrics.num_cached_tokens = item.start_position if item.is_prefill else 0
        if item.is_prefill:
            num_prefill_tokens += item.num_tokens
            num_prefill += 1
        else:
            num_decode_tokens += item.num_tokens
            num_decode += 1
    for update in updates:
        metrics = update.request.metrics
        if update.new_token_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
        if update.request.is_finished and metrics.finished_time is None:
            metrics.finished_time = now
    return StepStats(duration, num_prefill_tokens, num_decode_tokens, num_prefill, num_decode)
