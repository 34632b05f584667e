"""JSON log lines (--json-output): each parses, and carries the id (and trace id) of the
request that caused it; the text format names the request too."""

from __future__ import annotations

import io
import json
import logging

import httpx
import pytest

from ember.api.logs import create_handler
from ember.api.observability import RequestContext, activate, deactivate
from server_utils import running_server

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def captured():
    """The `ember` logger's records, as --json-output writes them."""
    stream = io.StringIO()
    handler = create_handler(stream, json_output=True)
    logger = logging.getLogger("ember")
    previous = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def lines(stream: io.StringIO) -> list[dict]:
    text = stream.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]  # every line is one JSON object


def test_access_log_lines_carry_the_request_id(tiny_llama_dir, captured):
    with running_server(tiny_llama_dir, max_total_tokens=64) as (url, _):
        ok = httpx.post(f"{url}/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}},
                        headers={"x-request-id": "log-me-1", "traceparent": TRACEPARENT}, timeout=60)
        bad = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": ""}, headers={"x-request-id": "log-me-2"})
        generated = httpx.post(f"{url}/generate_stream", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200 and bad.status_code == 422 and generated.status_code == 200
    records = lines(captured)
    for record in records:
        assert set(record) == {"timestamp", "level", "logger", "request_id", "trace_id", "message", "fields"}
        assert record["timestamp"].endswith("+00:00") and record["level"] in ("DEBUG", "INFO", "WARNING", "ERROR")
    by_id = {r["request_id"]: r for r in records if r["logger"] == "ember.api.access"}
    first = by_id["log-me-1"]
    assert first["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"  # the client's trace, even without tracing
    assert first["message"].startswith("POST /generate 200 success")
    assert first["fields"]["status"] == 200 and first["fields"]["generated_tokens"] == 3
    assert first["fields"]["prompt_tokens"] >= 1 and first["fields"]["duration_s"] > 0
    second = by_id["log-me-2"]
    assert second["fields"]["status"] == 422 and second["fields"]["error_type"] == "validation"
    assert second["fields"]["outcome"] == "client_error" and second["trace_id"] is None
    streamed = by_id[generated.headers["x-request-id"]]
    assert streamed["fields"]["generated_tokens"] == 2 and streamed["fields"]["path"] == "/generate_stream"
    # records outside any request (startup, the engine thread) have no id
    assert any(r["request_id"] is None for r in records)


def test_any_log_call_inside_a_request_gets_its_ids(captured):
    token = activate(RequestContext("rid-7", "/generate", "POST", trace_id="ab" * 16))
    try:
        logging.getLogger("ember.something").warning("queue is long: %d", 12, extra={"fields": {"queue": 12}})
    finally:
        deactivate(token)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("ember.other").exception("failed")
    warning, failure = lines(captured)
    assert warning == {**warning, "request_id": "rid-7", "trace_id": "ab" * 16, "level": "WARNING",
                       "message": "queue is long: 12", "fields": {"queue": 12}, "logger": "ember.something"}
    assert failure["request_id"] is None and "RuntimeError: boom" in failure["fields"]["exception"]


def test_text_format_names_the_request(tiny_llama_dir):
    stream = io.StringIO()
    handler = create_handler(stream, json_output=False)
    logger = logging.getLogger("ember.api.access")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    try:
        with running_server(tiny_llama_dir, max_total_tokens=64) as (url, _):
            httpx.post(f"{url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 1}},
                       headers={"x-request-id": "text-1"}, timeout=60)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
    assert "POST /generate 200 success" in stream.getvalue() and "(request text-1)" in stream.getvalue()


def test_cli_errors_are_json_too_with_json_output(capsys):
    from ember.api.cli import main

    assert main(["serve", "--model-id", "/nonexistent", "--json-output", "--max-input-tokens", "9", "--max-total-tokens", "5"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    record = json.loads(line)
    assert record["level"] == "ERROR" and record["logger"] == "ember.cli" and record["request_id"] is None
    assert record["message"].startswith("--max-input-tokens (9) must be < --max-total-tokens (5)")
    assert main(["serve", "--model-id", "/nonexistent", "--max-input-tokens", "9", "--max-total-tokens", "5"]) == 2
    assert capsys.readouterr().err.startswith("ember: error: --max-input-tokens (9)")
