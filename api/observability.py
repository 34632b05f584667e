"""What the API records about requests: the context of each request, Prometheus
metrics, OpenTelemetry traces.

The middleware creates a `RequestContext` per request and makes it current (a
context variable, so the route, its stream and the tasks they start all see the
same object); routes and the service write into it (an error, each engine
request's timings as a `GenerationRecord`), and the middleware reads it at the end
for metrics, the span tree and the access log.

Metrics are on ``GET /metrics`` (names and their TGI / vLLM equivalents:
docs/operations.md). Each app owns a `CollectorRegistry` (never the process-global
one), so several apps in one process (tests) do not share counts. Counters and
histograms are updated as requests end and engine steps complete (the engine thread
observes steps: the client library is thread-safe); gauges are read from the engine
when scraped.

Traces: one span per API request, its stages as child spans.

    POST /generate            (SERVER span; W3C traceparent honoured)
    ├── validation            (reading, parsing and checking the request)
    └── generate              (one per engine request; token counts as attributes)
        ├── queue             (handed to the engine -> first scheduled)
        ├── prefill           (first scheduled -> first token)
        └── decode            (first token -> last output; event `detokenize`)

The children are built when the request ends, from the engine's timestamps, so the
engine loop never touches a tracer. Without an exporter there is no tracer at all:
requests pay for reading ``traceparent`` (its trace id is still logged and echoed
in ``x-trace-id``) and nothing else.

The CLI's logging (`ember.api.logs`) does not import this module: it imports torch,
Prometheus and OpenTelemetry, which only a server needs.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ember.api.openapi import documented
from ember.engine.client import EngineClient
from ember.outputs import RequestOutput
from ember.sched.step import StepStats

logger = logging.getLogger("ember.api.tracing")  # the name tracing has always logged under


# -- request context ---------------------------------------------------------------
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
    adapter: str | None = None  # the LoRA adapter's name; None: the base model

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
    def adapter(self) -> str | None:
        """The LoRA adapter the request's generations ran under (None: the base model)."""
        return next((g.adapter for g in self.generations if g.adapter is not None), None)

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


# -- metrics -----------------------------------------------------------------------
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                         0.75, 1.0, 2.5)
LENGTH_BUCKETS = tuple(float(2**k) for k in range(0, 18))  # 1 ... 131072 tokens


class ServerMetrics:
    """Every metric of one app, and the calls that update them."""

    def __init__(self, client: EngineClient, in_flight=lambda: 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "ember_requests", "HTTP requests to the API routes, by route, outcome "
            "(success, client_error, server_error, cancelled) and error type (none on success)",
            ["route", "outcome", "error_type"], registry=r,
        )
        self.request_duration = Histogram(
            "ember_request_duration_seconds", "Time from receiving an API request to the end of its response",
            ["route"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_duration = Histogram(
            "ember_request_queue_duration_seconds", "Time an engine request waited before its first step",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.time_to_first_token = Histogram(
            "ember_time_to_first_token_seconds", "Time from handing a request to the engine to its first generated token",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.time_per_output_token = Histogram(
            "ember_time_per_output_token_seconds", "Mean time between generated tokens of a request (one sample, "
            "at least two tokens)", buckets=TOKEN_LATENCY_BUCKETS, registry=r,
        )
        self.input_tokens = Histogram(
            "ember_request_input_tokens", "Prompt length of each engine request, in tokens",
            buckets=LENGTH_BUCKETS, registry=r,
        )
        self.generated_tokens = Histogram(
            "ember_request_generated_tokens", "Tokens generated by each engine request (all its samples)",
            buckets=LENGTH_BUCKETS, registry=r,
        )
        self.prompt_tokens_total = Counter(
            "ember_prompt_tokens", "Prompt tokens of engine requests (counted once per request, whatever n)", registry=r,
        )
        self.generation_tokens_total = Counter(
            "ember_generation_tokens", "Generated tokens (every sample's, aborted requests' too)", registry=r,
        )
        self.step_duration = Histogram(
            "ember_step_duration_seconds", "Engine step time (schedule, forward, sample) by kind: prefill, "
            "decode, or mixed (a step computing both)", ["kind"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.step_tokens = Counter(
            "ember_step_tokens", "Tokens computed by engine steps, by phase (prefill or decode)", ["phase"], registry=r,
        )
        # more per-request metrics (ember.api.routes.lora's per-adapter counters): called as each request ends
        self.request_observers: list[Callable[[RequestContext], None]] = []
        r.register(_EngineCollector(client, in_flight))
        client.add_step_listener(self.observe_step)

    def observe_step(self, stats: StepStats) -> None:
        self.step_duration.labels(stats.kind).observe(stats.duration_s)
        if stats.num_prefill_tokens:
            self.step_tokens.labels("prefill").inc(stats.num_prefill_tokens)
        if stats.num_decode_tokens:
            self.step_tokens.labels("decode").inc(stats.num_decode_tokens)

    def observe_request(self, ctx: RequestContext, duration_s: float) -> None:
        """One API request has ended (its response sent, or its stream closed)."""
        error_type = ctx.error_type or ("none" if ctx.outcome == "success" else ctx.outcome)
        self.requests.labels(ctx.route, ctx.outcome, error_type).inc()
        self.request_duration.labels(ctx.route).observe(duration_s)
        for g in ctx.generations:
            self.prompt_tokens_total.inc(g.num_prompt_tokens)
            self.generation_tokens_total.inc(g.num_generated_tokens)
            self.input_tokens.observe(g.num_prompt_tokens)
            self.generated_tokens.observe(g.num_generated_tokens)
            for value, histogram in (
                (g.queue_time, self.queue_duration),
                (g.time_to_first_token, self.time_to_first_token),
                (g.time_per_output_token, self.time_per_output_token),
            ):
                if value is not None:
                    histogram.observe(value)
        for observe in self.request_observers:
            observe(ctx)

    def routes(self) -> list[Route]:
        return [Route("/metrics", self.metrics, methods=["GET"])]

    @documented(summary="Prometheus metrics (text exposition format)", tag="Operations",
                text_media_type="text/plain")
    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _EngineCollector(Collector):
    """Gauges read from the engine at scrape time (plain reads of counts: safe while it steps)."""

    def __init__(self, client: EngineClient, in_flight) -> None:
        self.client = client
        self.in_flight = in_flight

    def describe(self):
        return []  # not known before collect (auto_describe would collect at registration)

    def collect(self):
        stats = self.client.stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield gauge("ember_requests_waiting", "Engine requests waiting to be scheduled (the queue)", stats.num_waiting)
        yield gauge("ember_requests_running", "Engine requests in the running batch", stats.num_running)
        yield gauge("ember_requests_in_flight", "API requests being served (held against --max-concurrent-requests)",
                    self.in_flight())
        yield gauge("ember_kv_cache_blocks_used", "KV cache blocks held by requests", stats.num_used_blocks)
        yield gauge("ember_kv_cache_blocks_total", "KV cache blocks in the pool", stats.num_total_blocks)
        yield gauge("ember_kv_cache_usage_ratio", "Fraction of the KV cache blocks held by requests",
                    stats.num_used_blocks / max(1, stats.num_total_blocks))
        yield gauge("ember_prefix_cache_hit_ratio", "Prompt tokens found in the prefix cache / prompt tokens "
                    "looked up, since start", stats.prefix_hit_rate)
        yield CounterMetricFamily("ember_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=stats.num_prefix_queries)
        yield CounterMetricFamily("ember_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=stats.num_prefix_hits)
        yield CounterMetricFamily("ember_grammar_compile_seconds", "Seconds spent compiling grammars "
                                  "(JSON schemas, regexes, choices) on the engine's compile threads",
                                  value=stats.grammar_compile_time_s)
        yield CounterMetricFamily("ember_grammar_compiles", "Grammars compiled (cache misses)",
                                  value=stats.num_grammar_compiles)
        yield CounterMetricFamily("ember_grammar_cache_hits", "Constrained requests whose grammar was cached "
                                  "(compiled or compiling)", value=stats.num_grammar_cache_hits)
        yield CounterMetricFamily("ember_grammar_compile_errors", "Grammars that failed to compile "
                                  "(invalid or unsupported constraints)", value=stats.num_grammar_compile_errors)
        yield CounterMetricFamily("ember_grammar_compile_timeouts", "Requests that waited past "
                                  "--grammar-compile-timeout for their grammar", value=stats.num_grammar_compile_timeouts)
        yield CounterMetricFamily("ember_engine_restarts", "Engine-core processes restarted after a death "
                                  "(--restart-engine-on-failure)", value=getattr(self.client, "num_restarts", 0))
        spec = stats.speculation
        if spec is not None:  # vLLM's spec_decode counters, per method
            for name, key, doc in (
                ("ember_spec_decode_num_draft_tokens", "num_draft_tokens", "Draft tokens proposed and verified"),
                ("ember_spec_decode_num_accepted_tokens", "num_accepted_tokens", "Draft tokens accepted"),
                ("ember_spec_decode_num_emitted_tokens", "num_emitted_tokens",
                 "Tokens emitted by steps verifying drafts (accepted plus one per verification)"),
                ("ember_spec_decode_num_drafts", "num_proposals", "Verifications of a request's drafts"),
            ):
                family = CounterMetricFamily(name, doc, labels=["method"])
                family.add_metric([spec["method"]], spec[key])
                yield family
            for name, key, doc in (
                ("ember_spec_decode_acceptance_rate", "acceptance_rate", "Accepted / proposed draft tokens, since start"),
                ("ember_spec_decode_mean_accepted_length", "mean_accepted_length",
                 "Tokens emitted per verification (1 + accepted drafts), since start"),
                ("ember_spec_decode_mean_drafts_per_decode", "mean_drafts_per_decode",
                 "Drafts verified per decoding request per decode-only step (the mean k, 0s included), since start"),
                ("ember_spec_decode_draft_step_fraction", "draft_step_fraction",
                 "Fraction of decode-only steps that verified drafts, since start"),
            ):
                family = GaugeMetricFamily(name, doc, labels=["method"])
                family.add_metric([spec["method"]], spec[key])
                yield family


# -- tracing -----------------------------------------------------------------------
TRACES_PATH = "/v1/traces"
_PROPAGATOR = TraceContextTextMapPropagator()


def otlp_traces_url(endpoint: str) -> str:
    """``http://collector:4318`` -> ``http://collector:4318/v1/traces`` (a full URL is kept)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


def create_otlp_provider(endpoint: str, service_name: str) -> TracerProvider:
    """A provider exporting over OTLP/HTTP (protobuf) in batches."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_traces_url(endpoint))))
    return provider


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class Tracing:
    """The app's tracer, or none. ``owns_provider``: shut the provider down with the app."""

    def __init__(self, provider: TracerProvider | None, owns_provider: bool = False) -> None:
        self.provider = provider
        self.owns_provider = owns_provider
        self.tracer = provider.get_tracer("ember.api") if provider is not None else None

    @property
    def is_enabled(self) -> bool:
        return self.tracer is not None

    def start_request(self, ctx: RequestContext, headers: Mapping[str, str]) -> trace.Span | None:
        """Join the client's trace (``traceparent``), start the request's span if tracing."""
        parent = _PROPAGATOR.extract(headers) if "traceparent" in headers else None
        if self.tracer is None:
            span_context = trace.get_current_span(parent).get_span_context() if parent is not None else None
            if span_context is not None and span_context.is_valid:
                ctx.trace_id = trace.format_trace_id(span_context.trace_id)
            return None
        span = self.tracer.start_span(
            f"{ctx.method} {ctx.route}", context=parent, kind=SpanKind.SERVER, start_time=_ns(ctx.start_time),
            attributes={"http.request.method": ctx.method, "http.route": ctx.route, "ember.request_id": ctx.request_id},
        )
        ctx.trace_id = trace.format_trace_id(span.get_span_context().trace_id)
        ctx.trace_context = trace.set_span_in_context(span, parent)
        return span

    def end_request(self, ctx: RequestContext, span: trace.Span | None, end_time: float) -> None:
        if span is None or self.tracer is None:
            return
        if span.is_recording():
            self._children(ctx, end_time)
            if ctx.adapter is not None:
                span.set_attribute("ember.lora.adapter", ctx.adapter)
            span.set_attributes({
                "http.response.status_code": ctx.status or 0,
                "ember.outcome": ctx.outcome,
                "gen_ai.usage.input_tokens": ctx.num_prompt_tokens,
                "gen_ai.usage.output_tokens": ctx.num_generated_tokens,
            })
            if ctx.error_type is not None:
                span.set_attribute("error.type", ctx.error_type)
            if ctx.outcome == "server_error":
                span.set_status(Status(StatusCode.ERROR, ctx.error_type or "server error"))
        span.end(end_time=_ns(end_time))

    def _children(self, ctx: RequestContext, end_time: float) -> None:
        tracer = self.tracer
        parent = ctx.trace_context
        if ctx.generations:
            validated = ctx.generations[0].start_time
        elif ctx.error_type is not None and (ctx.error_status or 500) < 500:
            validated = end_time  # refused: the whole request was its validation
        else:
            validated = None
        if validated is not None:
            span = tracer.start_span("validation", context=parent, start_time=_ns(ctx.start_time))
            if not ctx.generations and ctx.error_type is not None:
                span.set_status(Status(StatusCode.ERROR, ctx.error_type))
            span.end(end_time=_ns(max(ctx.start_time, validated)))
        for index, generation in enumerate(ctx.generations):
            self._generation(generation, index, parent, end_time)

    def _generation(self, g: GenerationRecord, index: int, parent, end_time: float) -> None:
        tracer = self.tracer
        end = g.end_time or end_time
        span = tracer.start_span("generate", context=parent, start_time=_ns(g.start_time), attributes={
            "ember.generation.index": index,
            "gen_ai.usage.input_tokens": g.num_prompt_tokens,
            "gen_ai.usage.output_tokens": g.num_generated_tokens,
            "ember.cached_tokens": g.num_cached_tokens,
            "ember.num_samples": g.num_samples,
            "gen_ai.response.finish_reasons": [r or "none" for r in g.finish_reasons],
        })
        if g.adapter is not None:
            span.set_attribute("ember.lora.adapter", g.adapter)
        inner = trace.set_span_in_context(span)
        stages = [("queue", g.start_time, g.first_scheduled_time or end)]
        if g.first_scheduled_time is not None:
            stages.append(("prefill", g.first_scheduled_time, g.first_token_time or end))
        if g.first_token_time is not None:
            stages.append(("decode", g.first_token_time, end))
        for name, start, stop in stages:
            child = tracer.start_span(name, context=inner, start_time=_ns(start))
            if name == "prefill":
                child.set_attribute("gen_ai.usage.input_tokens", g.num_prompt_tokens)
                child.set_attribute("ember.cached_tokens", g.num_cached_tokens)
            if name == "decode":
                child.set_attribute("gen_ai.usage.output_tokens", g.num_generated_tokens)
                child.add_event("detokenize", {"ember.detokenize.duration_s": g.detokenize_time},
                                timestamp=_ns(stop))
            child.end(end_time=_ns(max(start, stop)))
        if g.error_type is not None:
            span.set_status(Status(StatusCode.ERROR, g.error_type))
            span.set_attribute("error.type", g.error_type)
        span.end(end_time=_ns(max(g.start_time, end)))

    def shutdown(self) -> None:
        if self.provider is None:
            return
        try:
            if self.owns_provider:
                self.provider.shutdown()
            else:
                self.provider.force_flush()
        except Exception:
            logger.exception("flushing traces failed")
