"""Every route of the server's own /openapi.json fuzzed with schemathesis (issue 35 item 5;
the routes of issue 33 included as they landed): bounded examples per operation against
the tiny model, and every response checked by schemathesis' response checks: no 5xx, a
documented status code, a documented content type, and a body (errors included, in each
API's own error shape, and each streamed event) that matches the documented schema.

Not checked: that every schema-valid request is accepted (`positive_data_acceptance`):
the schemas cannot say everything the server checks (a prompt longer than the context,
a model name not served, an empty prompt), and those are refused with a 4xx by design."""

from __future__ import annotations

import httpx
import pytest
import schemathesis  # in the test extras: a missing install fails, not skips
from hypothesis import HealthCheck, given, settings
from server_utils import running_server

MAX_EXAMPLES = 12
SHORT = ("max_tokens", "max_new_tokens", "max_output_tokens", "max_completion_tokens")


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(tiny_llama_dir, engine={"enable_lora": True}, max_total_tokens=128,
                        enable_lora_runtime_updates=True) as running:
        yield running


@pytest.fixture(scope="module")
def document(server):
    return httpx.get(f"{server.url}/openapi.json", timeout=30).json()


def operations(document: dict) -> list[tuple[str, str]]:
    return [(path, method.upper()) for path, methods in document["paths"].items() for method in methods]


def test_the_document_names_every_route_of_this_wave(document):
    paths = set(document["paths"])
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                 "/v1/responses", "/v1/responses/{response_id}", "/v1/embeddings", "/v1/rerank", "/rerank",
                 "/v1/score", "/generate", "/generate_stream", "/v1/load_lora_adapter"):
        assert path in paths, path
    names = document["components"]["schemas"]
    # models of one name in two APIs (Usage, ErrorResponse) each keep their own schema
    usage = [name for name in names if name.endswith("Usage")]
    assert len(usage) >= 2 and len({str(names[name]) for name in usage}) == len(usage), usage


def test_every_operation_answers_as_documented(server, document):
    schema = schemathesis.openapi.from_dict(document)
    failures: list[str] = []
    for path, method in operations(document):
        operation = schema[path][method]

        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=True)
        def call(case):
            if isinstance(case.body, dict):  # short answers, one choice: the point is the validation
                case.body.update({key: 2 for key in SHORT if key in case.body})
                if "n" in case.body:
                    case.body["n"] = 1
            try:
                case.call_and_validate(base_url=server.url, timeout=60,
                                       excluded_checks=[schemathesis.checks.positive_data_acceptance])
            except Exception as exc:  # noqa: BLE001  (one report for all operations)
                failures.append(f"{method} {path}: {type(exc).__name__}: {str(exc)[:1500]}")

        call()
    assert not failures, "\n\n".join(failures[:5]) + f"\n\n({len(failures)} failures)"
