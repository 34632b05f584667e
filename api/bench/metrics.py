"""Per-request timings, and the figures of a run built from them (the result JSON).

Definitions (as vLLM's `bench serve` uses them):

- TTFT: from sending the request to the first chunk that carries text.
- E2EL: from sending the request to the end of its stream.
- TPOT: per request, ``(E2EL - TTFT) / (output tokens - 1)``; requests of one token have none.
- ITL: the gaps between consecutive text-carrying chunks, pooled over all requests.
- Throughput: completed requests, and output tokens, divided by the run's duration
  (first request sent to last response finished).
"""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ember.api.bench.stats import summarize

SCHEMA = "ember-bench/1"
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
MAX_ERRORS_REPORTED = 5


@dataclass(slots=True)
class RequestRecord:
    """What one request did. Times are seconds; `start_s` counts from the run's start,
    the others from `start_s`."""

    index: int
    scheduled_s: float  # when its arrival was due
    start_s: float = math.nan  # when it was sent (after waiting for a concurrency slot)
    ttft_s: float | None = None
    e2el_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # text-carrying chunks, from start_s
    num_input_tokens: int | None = None
    num_output_tokens: int = 0
    output_tokens_source: str = "chunks"  # usage | tokenizer | chunks | engine
    error: str | None = None

    @property
    def is_success(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if not self.is_success or self.ttft_s is None or self.e2el_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.num_output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        times = self.chunk_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "scheduled_s": self.scheduled_s,
            "start_s": self.start_s,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2el_s": self.e2el_s,
            "input_tokens": self.num_input_tokens,
            "output_tokens": self.num_output_tokens,
            "output_tokens_source": self.output_tokens_source,
            "chunk_times_s": self.chunk_times_s,
            "error": self.error,
        }


def build_result(kind: str, config: dict[str, Any], records: list[RequestRecord], duration_s: float,
                 started_at: dt.datetime, label: str) -> dict[str, Any]:
    """The result JSON of one run (schema `SCHEMA`, described in docs/bench.md)."""
    done = [r for r in records if r.is_success]
    failed = [r for r in records if not r.is_success]
    num_output = sum(r.num_output_tokens for r in done)
    inputs = [r.num_input_tokens for r in done]
    num_input = sum(inputs) if inputs and all(n is not None for n in inputs) else None
    sources = sorted({r.output_tokens_source for r in done})
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "kind": kind,
        "label": label,
        "started_at": started_at.isoformat(timespec="seconds"),
        "config": config,
        "duration_s": duration_s,
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(failed),
        "errors": [
            {"message": message, "count": count}
            for message, count in Counter(r.error for r in failed).most_common(MAX_ERRORS_REPORTED)
        ],
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "output_tokens_source": sources[0] if len(sources) == 1 else ("mixed" if sources else None),
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(num_output),
        "total_token_throughput": per_s(num_output + num_input) if num_input is not None else None,
        "ttft_ms": summarize([r.ttft_s for r in done if r.ttft_s is not None], 1000),
        "tpot_ms": summarize([r.tpot_s for r in done if r.tpot_s is not None], 1000),
        "itl_ms": summarize([gap for r in done for gap in r.itl_s], 1000),
        "e2el_ms": summarize([r.e2el_s for r in done if r.e2el_s is not None], 1000),
        "throughput_over_time": throughput_over_time(done, duration_s),
        "requests": [r.to_dict() for r in records],
    }
    return result


def throughput_over_time(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Output tokens per second and requests in flight, in equal time bins (1 s, or
    1/20 of a run shorter than 20 s). A chunk of a request whose token count came
    from `usage` counts as that request's tokens divided evenly over its chunks."""
    bin_s = 1.0 if duration_s >= 20 else max(duration_s / 20, 1e-3)
    num_bins = max(1, math.ceil(duration_s / bin_s))
    tokens = [0.0] * num_bins
    in_flight = [0] * num_bins
    for r in records:
        if r.chunk_times_s:
            weight = r.num_output_tokens / len(r.chunk_times_s)
            for t in r.chunk_times_s:
                tokens[min(int((r.start_s + t) / bin_s), num_bins - 1)] += weight
        if r.e2el_s is not None:
            first = min(int(r.start_s / bin_s), num_bins - 1)
            last = min(int((r.start_s + r.e2el_s) / bin_s), num_bins - 1)
            for b in range(first, last + 1):
                in_flight[b] += 1
    return {
        "bin_s": bin_s,
        "output_tokens_per_s": [n / bin_s for n in tokens],
        "requests_in_flight": in_flight,
    }
