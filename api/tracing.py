"""OpenTelemetry traces: one span per API request, its stages as child spans.

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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ember.api.context import GenerationRecord, RequestContext

logger = logging.getLogger(__name__)

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
