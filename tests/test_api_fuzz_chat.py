"""Schemathesis over /v1/chat/completions from the server's own /openapi.json (issue 33,
"Bad input" was found this way): bounded examples, no response may be a 5xx."""

from __future__ import annotations

import httpx
import pytest
import schemathesis  # in the test extras: a missing install fails, not skips
from hypothesis import HealthCheck, given, settings
from server_utils import running_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=128) as running:
        yield running


def test_chat_completions_never_answers_5xx(server):
    document = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    operation = schemathesis.openapi.from_dict(document)["/v1/chat/completions"]["POST"]

    @given(case=operation.as_strategy())
    @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def call(case):
        if isinstance(case.body, dict):  # short answers, one choice: the point is the validation
            body = {key: value for key, value in case.body.items() if key != "max_completion_tokens"}
            case.body = {**body, "max_tokens": 2, **({"n": 1} if "n" in body else {})}
        response = case.call(base_url=server.url, timeout=60)
        assert response.status_code < 500, (case.body, response.text)

    call()
