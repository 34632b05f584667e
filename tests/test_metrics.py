"""GET /metrics after a known workload on a real server (tiny random Llama), read back
with prometheus-client's own parser: exact request and token counts, sane histograms,
gauges that follow the engine."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_utils import running_server, wait_idle


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=256) as running:
        yield running


def scrape(url: str, app=None) -> dict[str, list]:
    """The metrics; with ``app``, once the requests already answered are all recorded."""
    if app is not None:
        wait_idle(app)
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {family.name: family.samples for family in text_string_to_metric_families(r.text)}


def value(families: dict, family: str, sample: str | None = None, **labels: str) -> float:
    """The value of one sample (0 when absent: a label set never observed)."""
    name = sample or family
    matches = [s.value for s in families.get(family, []) if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) <= 1, f"{name}{labels} is ambiguous: {matches}"
    return matches[0] if matches else 0.0


def test_exact_counts_after_a_known_workload(server):
    url, app = server
    service = app.state.service
    before = scrape(url, app)
    prompts = ["hello world", "the quick brown fox", "a"]
    expected_prompt = expected_generated = 0
    for i, prompt in enumerate(prompts):  # /generate, greedy: the tiny model never stops early
        r = httpx.post(f"{url}/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 3 + i, "details": True}}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["details"]["generated_tokens"] == 3 + i
        expected_prompt += len(service.encode(prompt))
        expected_generated += 3 + i
    r = httpx.post(f"{url}/generate_stream", json={"inputs": "stream me", "parameters": {"max_new_tokens": 5}}, timeout=60)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert len(events) == 5
    expected_prompt += events[-1]["details"]["input_length"]
    expected_generated += 5
    r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": ["one", "two"], "max_tokens": 4, "n": 2}, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    expected_prompt += usage["prompt_tokens"]
    expected_generated += usage["completion_tokens"]
    assert usage["completion_tokens"] == 16
    # failures: a validation error, an unknown field (OpenAI), a missing route
    assert httpx.post(f"{url}/generate", json={"inputs": "", "parameters": {}}).status_code == 422
    assert httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "bogus": 1}).status_code == 422
    assert httpx.get(f"{url}/nowhere").status_code == 404

    after = scrape(url, app)

    def delta(family, sample=None, **labels):
        return value(after, family, sample, **labels) - value(before, family, sample, **labels)

    req = "ember_requests"
    assert delta(req, "ember_requests_total", route="/generate", outcome="success", error_type="none") == 3
    assert delta(req, "ember_requests_total", route="/generate_stream", outcome="success", error_type="none") == 1
    assert delta(req, "ember_requests_total", route="/v1/completions", outcome="success", error_type="none") == 1
    assert delta(req, "ember_requests_total", route="/generate", outcome="client_error", error_type="validation") == 1
    assert delta(req, "ember_requests_total", route="/v1/completions", outcome="client_error", error_type="validation") == 1
    assert delta(req, "ember_requests_total", route="other", outcome="client_error", error_type="not_found") == 1
    assert sum(s.value for s in after[req] if s.name == "ember_requests_total") - sum(
        s.value for s in before.get(req, []) if s.name == "ember_requests_total") == 8

    assert delta("ember_prompt_tokens", "ember_prompt_tokens_total") == expected_prompt
    assert delta("ember_generation_tokens", "ember_generation_tokens_total") == expected_generated == 33

    # one observation per engine request: 3 + 1 + 2 (two prompts, n=2 each)
    num_engine_requests = 6
    for family in ("ember_request_input_tokens", "ember_request_generated_tokens", "ember_request_queue_duration_seconds",
                   "ember_time_to_first_token_seconds"):
        assert delta(family, f"{family}_count") == num_engine_requests, family
    assert delta("ember_request_input_tokens", "ember_request_input_tokens_sum") == expected_prompt
    assert delta("ember_request_generated_tokens", "ember_request_generated_tokens_sum") == expected_generated
    # time per output token: one-sample requests with >= 2 tokens (the n=2 completions are not)
    assert delta("ember_time_per_output_token_seconds", "ember_time_per_output_token_seconds_count") == 4
    assert delta("ember_request_duration_seconds", "ember_request_duration_seconds_count", route="/generate") == 4
    # buckets are cumulative and end at +Inf == count
    buckets = [s for s in after["ember_time_to_first_token_seconds"] if s.name.endswith("_bucket")]
    assert [s.value for s in buckets] == sorted(s.value for s in buckets)
    assert buckets[-1].labels["le"] == "+Inf"
    assert buckets[-1].value == value(after, "ember_time_to_first_token_seconds", "ember_time_to_first_token_seconds_count")
    ttft_sum = delta("ember_time_to_first_token_seconds", "ember_time_to_first_token_seconds_sum")
    duration_sum = delta("ember_request_duration_seconds", "ember_request_duration_seconds_sum", route="/generate")
    assert 0 < ttft_sum < 60 and 0 < duration_sum < 60

    # steps: every generated token was decoded or sampled at the end of a prefill
    decode = delta("ember_step_tokens", "ember_step_tokens_total", phase="decode")
    prefill = delta("ember_step_tokens", "ember_step_tokens_total", phase="prefill")
    # n=2: the second sample of each prompt computes (the uncached part of) the prompt again
    assert 0 < prefill <= expected_prompt + usage["prompt_tokens"]
    num_samples = 3 + 1 + 2 * 2
    assert decode == expected_generated - num_samples  # each sample's first token ends its prefill
    steps = sum(delta("ember_step_duration_seconds", "ember_step_duration_seconds_count", kind=k) for k in ("prefill", "decode", "mixed"))
    assert steps >= 7  # at least as many steps as the longest request has tokens (the 7-token stream... and more)

    # idle engine: nothing queued or running, no blocks held
    assert value(after, "ember_requests_waiting") == 0 and value(after, "ember_requests_running") == 0
    assert value(after, "ember_kv_cache_blocks_used") == 0
    assert value(after, "ember_kv_cache_blocks_total") == 128
    assert 0 <= value(after, "ember_prefix_cache_hit_ratio") <= 1


def test_gauges_follow_a_request_in_flight(server):
    url, app = server
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}/generate_stream", json={"inputs": "keep going", "parameters": {"max_new_tokens": 200}}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # the stream has begun
            during = scrape(url)
    assert value(during, "ember_requests_running") == 1
    assert value(during, "ember_requests_in_flight") == 1
    assert value(during, "ember_kv_cache_blocks_used") >= 2  # prompt + tokens so far, 8 tokens a block
    deadline = time.monotonic() + 10  # the server notices the disconnect at its next event
    while value(after := scrape(url), "ember_requests_in_flight") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert value(after, "ember_requests_in_flight") == 0
    after = scrape(url, app)
    # the client left mid-stream: counted as cancelled, not as a success
    assert value(after, "ember_requests", "ember_requests_total", route="/generate_stream", outcome="cancelled",
                 error_type="cancelled") >= 1


def test_each_app_has_its_own_registry(server, tiny_llama_dir):
    url, app = server
    with running_server(tiny_llama_dir, max_total_tokens=64) as (other_url, other_app):
        assert other_app.state.metrics.registry is not app.state.metrics.registry
        httpx.post(f"{other_url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}}, timeout=60)
        other = scrape(other_url, other_app)
        assert value(other, "ember_requests", "ember_requests_total", route="/generate", outcome="success", error_type="none") == 1
        assert value(other, "ember_generation_tokens", "ember_generation_tokens_total") == 2


def test_metrics_and_health_are_not_counted(server):
    url, _ = server
    before = scrape(url)
    for _ in range(3):
        httpx.get(f"{url}/health")
        httpx.get(f"{url}/info")
    after = scrape(url)
    total = lambda fams: sum(s.value for s in fams.get("ember_requests", []) if s.name == "ember_requests_total")  # noqa: E731
    assert total(after) == total(before)
