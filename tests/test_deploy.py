"""The monitoring files (docs/deploy.md): the Grafana dashboard asks only for series a real
Ember server exports, its queries evaluate in a real Prometheus scraping that server, and
docker/compose.yaml wires Ember, Prometheus and Grafana to the files this repository has.

The server runs the tiny model with n-gram speculation, and gets a plain request and a
JSON-schema one, so that the speculation and grammar series exist on /metrics.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from server_utils import running_server, wait_idle

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "ember-dashboard.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
COMPOSE = ROOT / "docker" / "compose.yaml"
COMPOSE_SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"
CHART_VALUES = ROOT / "deploy" / "helm" / "ember" / "values.yaml"
METRIC_NAME = re.compile(r"\bember_[a-z0-9_]+\b")
# What the dashboard must show (issue 34): throughput, TTFT and ITL percentiles, queue, running
# requests, KV-cache use, prefix-cache hits, speculation acceptance, grammar compile time.
REQUIRED = {
    "ember_generation_tokens_total", "ember_time_to_first_token_seconds_bucket",
    "ember_time_per_output_token_seconds_bucket", "ember_requests_waiting", "ember_requests_running",
    "ember_kv_cache_usage_ratio", "ember_prefix_cache_hits_total", "ember_prefix_cache_queries_total",
    "ember_spec_decode_num_accepted_tokens_total", "ember_spec_decode_num_draft_tokens_total",
    "ember_grammar_compile_seconds_total", "ember_grammar_compiles_total",
}
GRAMMAR_REQUEST = {
    "model": "tiny", "messages": [{"role": "user", "content": "a number"}], "max_tokens": 12,
    "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}},
}
PLAIN_REQUEST = {"model": "tiny", "messages": [{"role": "user", "content": "hello hello hello hello"}],
                 "max_tokens": 12}


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def exported_series(metrics_text: str) -> set[str]:
    return {sample.name for family in text_string_to_metric_families(metrics_text) for sample in family.samples}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    speculation = {"method": "ngram", "num_speculative_tokens": 3}
    with running_server(tiny_llama_dir, engine={"speculative_config": speculation}) as running:
        for body in (PLAIN_REQUEST, GRAMMAR_REQUEST):
            response = httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
        wait_idle(running.app)
        yield running


def test_dashboard_asks_only_for_series_the_server_exports(server):
    series = exported_series(httpx.get(f"{server.url}/metrics").text)
    asked = {name for query in dashboard_queries() for name in METRIC_NAME.findall(query)}
    assert asked - series == set(), f"the dashboard queries series /metrics does not have: {sorted(asked - series)}"
    assert REQUIRED <= asked, f"the dashboard lacks {sorted(REQUIRED - asked)}"
    # the chart's autoscaler scales on a series that exists too
    metric = yaml.safe_load(CHART_VALUES.read_text())["autoscaling"]["metricName"]
    assert metric in series


def test_dashboard_structure():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and all('instance=~"$instance"' in t["expr"] for t in panel["targets"]), panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def _skip_or_fail(reason: str) -> None:
    """Skip where Prometheus is not installed; in CI (CI set), which installs it, fail."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_prometheus_config_passes_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        _skip_or_fail("promtool not installed (apt-get install prometheus; .ci/run does)")
    result = subprocess.run([promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_queries_evaluate_in_prometheus(server, tmp_path):
    """A real Prometheus scrapes the server each second; every panel's query then parses and
    returns a result, and the dashboard's instance variable finds the server."""
    binary = shutil.which("prometheus")
    if binary is None:
        _skip_or_fail("prometheus not installed (apt-get install prometheus; .ci/run does)")
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    config["scrape_configs"][0]["static_configs"] = [{"targets": [server.url.removeprefix("http://")]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    process = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        deadline = time.monotonic() + 60
        scrapes = 0
        while scrapes < 4:  # rate() needs two samples in its window: traffic between scrapes
            assert time.monotonic() < deadline, process.stderr.read1().decode() if process.poll() is not None else ""
            try:  # refused, then 503 while the server starts
                response = httpx.get(f"{api}/query", params={"query": "count_over_time(up[1m])"})
            except httpx.TransportError:
                response = None
            if response is not None and response.status_code == 200:
                result = response.json()["data"]["result"]
                scrapes = int(result[0]["value"][1]) if result else 0
            httpx.post(f"{server.url}/v1/chat/completions", json=GRAMMAR_REQUEST if scrapes % 2 else PLAIN_REQUEST,
                       timeout=60)
            time.sleep(0.5)
        (up,) = httpx.get(f"{api}/query", params={"query": "up"}).json()["data"]["result"]
        assert up["value"][1] == "1" and up["metric"]["job"] == "ember"
        instance = up["metric"]["instance"]
        series = httpx.get(f"{api}/series", params={"match[]": "ember_requests_running"}).json()["data"]
        assert [s["instance"] for s in series] == [instance]  # the dashboard's label_values(…, instance)
        for query in dashboard_queries():
            promql = query.replace("$__rate_interval", "1m").replace("$instance", instance)
            answer = httpx.get(f"{api}/query", params={"query": promql}).json()
            assert answer["status"] == "success", (query, answer)
            assert answer["data"]["result"], f"no result for {query}"
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_compose_file_matches_the_compose_specification():
    """tests/data/compose-spec.json is the Compose Specification's JSON schema (compose-spec/compose-spec,
    schema/compose-spec.json at a08f8d5, Apache-2.0): what `docker compose config` checks first."""
    validator = jsonschema.Draft7Validator(json.loads(COMPOSE_SCHEMA.read_text()))
    compose = yaml.safe_load(COMPOSE.read_text())
    assert [error.message for error in validator.iter_errors(compose)] == []
    compose["services"]["ember"]["port"] = "3000"  # a misspelt key is caught
    assert any("'port'" in error.message for error in validator.iter_errors(compose))


def test_compose_wires_ember_prometheus_and_grafana():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"ember", "prometheus", "grafana"}
    base = COMPOSE.parent
    build = services["ember"]["build"]
    assert (base / build["context"] / build["dockerfile"]).resolve() == (ROOT / "docker" / "Dockerfile")
    assert "ember-cache:/data" in services["ember"]["volumes"]  # the image's VOLUME
    assert services["ember"]["ports"] == ["3000:3000"]
    named = set(compose["volumes"])
    mounts = {}
    for name, service in services.items():
        assert service.get("image"), f"{name} has no image"
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                assert (base / source).exists(), f"{name} mounts {source}, which does not exist"
                mounts[target] = (base / source).resolve()
            else:
                assert source in named, f"{name} mounts the undeclared volume {source}"
    assert services["prometheus"]["image"].startswith("prom/prometheus:v")  # pinned, not latest
    assert services["grafana"]["image"].startswith("grafana/grafana:") and "latest" not in services["grafana"]["image"]
    # Prometheus scrapes the ember service on the port the image listens on (EMBER_PORT 3000)
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS_CONFIG
    (job,) = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    assert job["static_configs"] == [{"targets": ["ember:3000"]}] and job["metrics_path"] == "/metrics"
    # Grafana gets the Prometheus service as its data source, and the dashboard where its provider looks
    provisioning = mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "ember.yaml").read_text())["providers"]
    dashboard_target = next(t for t, path in mounts.items() if path == DASHBOARD)
    assert Path(dashboard_target).parent == Path(provider["options"]["path"])
    assert services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard_target
