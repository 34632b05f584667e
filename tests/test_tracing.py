"""OpenTelemetry traces: spans collected with the SDK's in-memory exporter, and
separately through the real OTLP/HTTP exporter into a receiver on 127.0.0.1 (decoded
with opentelemetry-proto); parent-child links, token counts, the client's trace id."""

from __future__ import annotations

import gzip
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from server_utils import running_server, wait_idle

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


@pytest.fixture(scope="module")
def traced(tiny_llama_dir):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with running_server(tiny_llama_dir, max_total_tokens=64, tracer_provider=provider) as (url, app):
        yield url, app, exporter


def spans_of(exporter: InMemorySpanExporter, trace_id: str, app=None) -> dict[str, list]:
    """The finished spans of one trace by name; with ``app``, once its requests are recorded."""
    if app is not None:
        wait_idle(app)
    by_name: dict[str, list] = {}
    for span in exporter.get_finished_spans():
        if format(span.context.trace_id, "032x") == trace_id:
            by_name.setdefault(span.name, []).append(span)
    return by_name


def test_a_request_is_a_span_tree_in_the_clients_trace(traced):
    url, app, exporter = traced
    r = httpx.post(f"{url}/generate", json={"inputs": "hello world", "parameters": {"max_new_tokens": 4}},
                   headers={"traceparent": TRACEPARENT, "x-request-id": "traced-1"}, timeout=60)
    assert r.status_code == 200
    assert r.headers["x-trace-id"] == TRACE_ID
    spans = spans_of(exporter, TRACE_ID, app)
    assert sorted(spans) == ["POST /generate", "decode", "generate", "prefill", "queue", "validation"]
    (root,) = spans["POST /generate"]
    assert root.kind is SpanKind.SERVER
    assert format(root.parent.span_id, "016x") == PARENT_SPAN_ID and root.parent.is_remote
    assert root.attributes["ember.request_id"] == "traced-1"
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["gen_ai.usage.output_tokens"] == 4
    num_prompt = root.attributes["gen_ai.usage.input_tokens"]
    assert num_prompt >= 2
    (validation,), (generate,) = spans["validation"], spans["generate"]
    assert validation.parent.span_id == root.context.span_id
    assert generate.parent.span_id == root.context.span_id
    assert generate.attributes["gen_ai.usage.input_tokens"] == num_prompt
    assert generate.attributes["gen_ai.usage.output_tokens"] == 4
    assert tuple(generate.attributes["gen_ai.response.finish_reasons"]) == ("length",)
    stages = [spans[name][0] for name in ("queue", "prefill", "decode")]
    for stage in stages:
        assert stage.parent.span_id == generate.context.span_id
        assert generate.start_time <= stage.start_time <= stage.end_time <= generate.end_time
    assert stages[0].end_time == stages[1].start_time and stages[1].end_time == stages[2].start_time  # contiguous
    assert root.start_time <= validation.start_time <= validation.end_time <= generate.start_time
    assert generate.end_time <= root.end_time
    decode = stages[2]
    assert decode.attributes["gen_ai.usage.output_tokens"] == 4
    (event,) = decode.events
    assert event.name == "detokenize" and event.attributes["ember.detokenize.duration_s"] > 0


def test_without_traceparent_a_new_trace_starts(traced):
    url, app, exporter = traced
    r = httpx.post(f"{url}/generate_stream", json={"inputs": "hi", "parameters": {"max_new_tokens": 3}}, timeout=60)
    trace_id = r.headers["x-trace-id"]
    assert len(trace_id) == 32 and trace_id != TRACE_ID
    spans = spans_of(exporter, trace_id, app)
    (root,) = spans["POST /generate_stream"]
    assert root.parent is None
    assert root.attributes["gen_ai.usage.output_tokens"] == 3 and root.attributes["ember.outcome"] == "success"
    assert root.attributes["ember.request_id"] == r.headers["x-request-id"]


def test_several_engine_requests_and_refusals(traced):
    url, app, exporter = traced
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": ["one", "two"], "max_tokens": 2, "n": 2},
                   headers={"traceparent": parent}, timeout=60)
    assert r.status_code == 200
    spans = spans_of(exporter, "0af7651916cd43dd8448eb211c80319c", app)
    generates = spans["generate"]
    assert sorted(g.attributes["ember.generation.index"] for g in generates) == [0, 1]
    assert all(g.attributes["gen_ai.usage.output_tokens"] == 4 and g.attributes["ember.num_samples"] == 2 for g in generates)
    assert len(spans["queue"]) == len(spans["prefill"]) == len(spans["decode"]) == 2
    refused = httpx.post(f"{url}/generate", json={"inputs": ""}, headers={"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"})
    assert refused.status_code == 422
    spans = spans_of(exporter, "1" * 32, app)
    assert sorted(spans) == ["POST /generate", "validation"]
    assert spans["validation"][0].status.status_code is StatusCode.ERROR
    assert spans["POST /generate"][0].attributes["error.type"] == "validation"
    # open routes are not traced; a malformed traceparent starts a new trace
    httpx.get(f"{url}/health", headers={"traceparent": f"00-{'3' * 32}-{'4' * 16}-01"})
    assert not spans_of(exporter, "3" * 32, app)
    r = httpx.post(f"{url}/tokenize", json={"inputs": "x"}, headers={"traceparent": "00-zz-yy-01"})
    assert r.status_code == 200 and len(r.headers["x-trace-id"]) == 32


def test_without_an_exporter_there_is_no_tracer(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=64) as (url, app):
        assert app.state.tracing.tracer is None and not app.state.tracing.is_enabled
        r = httpx.post(f"{url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 1}}, timeout=60)
        assert "x-trace-id" not in r.headers
        r = httpx.post(f"{url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 1}},
                       headers={"traceparent": TRACEPARENT}, timeout=60)
        assert r.headers["x-trace-id"] == TRACE_ID  # the client's trace id is still echoed (and logged)


class _Receiver(BaseHTTPRequestHandler):
    """A minimal OTLP/HTTP trace receiver: keeps each decoded export request."""

    received: list[tuple[str, ExportTraceServiceRequest]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        encoding = self.headers.get("Content-Encoding")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.received.append((self.path, request))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(b"")

    def log_message(self, format, *args) -> None:
        pass


def test_spans_reach_an_otlp_http_receiver(tiny_llama_dir):
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    _Receiver.received = []
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    try:
        with running_server(tiny_llama_dir, max_total_tokens=64, otlp_endpoint=endpoint, otlp_service_name="ember-test") as (url, _):
            r = httpx.post(f"{url}/generate", json={"inputs": "over the wire", "parameters": {"max_new_tokens": 3}},
                           headers={"traceparent": TRACEPARENT}, timeout=60)
            assert r.status_code == 200 and r.headers["x-trace-id"] == TRACE_ID
        # leaving the server shut the provider down, which flushed the batch
    finally:
        receiver.shutdown()
    assert _Receiver.received and all(path == "/v1/traces" for path, _ in _Receiver.received)
    spans = {}
    for _, request in _Receiver.received:
        for resource_spans in request.resource_spans:
            attributes = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
            assert attributes["service.name"] == "ember-test"
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    if span.trace_id.hex() == TRACE_ID:
                        spans[span.name] = span
    assert sorted(spans) == ["POST /generate", "decode", "generate", "prefill", "queue", "validation"]
    root = spans["POST /generate"]
    assert root.parent_span_id.hex() == PARENT_SPAN_ID
    assert spans["generate"].parent_span_id == root.span_id == spans["validation"].parent_span_id
    for name in ("queue", "prefill", "decode"):
        assert spans[name].parent_span_id == spans["generate"].span_id
    tokens = {kv.key: kv.value.int_value for kv in spans["generate"].attributes}
    assert tokens["gen_ai.usage.output_tokens"] == 3 and tokens["gen_ai.usage.input_tokens"] >= 2
