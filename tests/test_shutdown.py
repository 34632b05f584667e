"""Readiness and graceful shutdown: /health is 503 until the warm-up pass ran; SIGTERM
to a real `ember serve` (tiny model) lets 8 streams in flight finish, answers new
requests 503, exits 0; past --graceful-termination-timeout the requests still running
end with an error event or an error body, never silently."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_serve_cli import free_port


def sse_events(lines) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]


# The streams must still be running when the signal lands, and the tiny Llama's context
# holds 240 tokens: through the few-row GEMV and CPU graphs it decoded them before SIGTERM
# was handled (CI, 2026-12-06). oneDNN's products, eagerly, as these tests were written for.
STEADY_DECODE = ("--backend-option", "small_batch_rows=0")


class Serve:
    """`ember serve --json-output` in a subprocess; stderr goes to a file."""

    def __init__(self, model_dir: Path, log: Path, *args: str) -> None:
        exe = shutil.which("ember", path=os.path.dirname(sys.executable))
        assert exe, "the `ember` console script is not installed next to this Python"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [exe, "serve", "--model-id", str(model_dir), "--port", str(self.port), "--json-output",
                 "--max-total-tokens", "256", "--max-batch-total-tokens", "4096", *STEADY_DECODE, *args],
                stdout=out, stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.1)
        raise AssertionError(f"not ready within {timeout} s:\n{self.log.read_text()}")

    def log_records(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]  # every line is JSON

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_streams(url: str, num: int, max_new_tokens: int) -> tuple[list[threading.Thread], list[dict], list[threading.Event]]:
    """`num` /generate_stream clients in threads; results[i] gets status, events, error."""
    results: list[dict] = [{} for _ in range(num)]
    begun = [threading.Event() for _ in range(num)]

    def run(i: int) -> None:
        try:
            body = {"inputs": f"stream number {i}", "parameters": {"max_new_tokens": max_new_tokens}}
            with httpx.stream("POST", f"{url}/generate_stream", json=body, headers={"x-request-id": f"stream-{i}"},
                              timeout=120) as r:
                results[i]["status"] = r.status_code
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    begun[i].set()
                results[i]["events"] = sse_events(lines)
        except Exception as exc:  # recorded, asserted on by the test
            results[i]["error"] = repr(exc)
        finally:
            begun[i].set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(num)]
    for thread in threads:
        thread.start()
    return threads, results, begun


@pytest.fixture
def serve(tiny_llama_dir, tmp_path):
    servers: list[Serve] = []

    def start(*args: str) -> Serve:
        server = Serve(tiny_llama_dir, tmp_path / f"serve-{len(servers)}.log", *args)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def test_sigterm_lets_eight_streams_finish_and_refuses_new_requests(serve):
    server = serve("--graceful-termination-timeout", "60")
    server.wait_ready()
    url = server.url
    threads, results, begun = start_streams(url, 8, max_new_tokens=240)
    for event in begun:
        assert event.wait(60)
    assert all("error" not in r for r in results), results
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.time() + 10
    while httpx.get(f"{url}/health", timeout=10).status_code == 200:  # until the signal is handled
        assert time.time() < deadline
        time.sleep(0.01)
    # draining: new requests get 503 in their route's shape; health says why; metrics still answer
    refused = httpx.post(f"{url}/generate", json={"inputs": "late", "parameters": {"max_new_tokens": 2}}, timeout=10)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error_type"] == "shutting_down"
    refused_oa = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "late", "max_tokens": 2}, timeout=10)
    assert refused_oa.status_code == 503 and refused_oa.json()["error"]["type"] == "service_unavailable"
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["error_type"] == "shutting_down"
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
    still_running = sum(thread.is_alive() for thread in threads)
    assert still_running >= 1  # the streams really were in flight while new requests were refused
    for thread in threads:
        thread.join(120)
    assert server.proc.wait(60) == 0
    for i, result in enumerate(results):
        assert "error" not in result and result["status"] == 200, result
        events = result["events"]
        assert len(events) == 240, f"stream {i}: {len(events)} events"
        assert events[-1]["details"]["finish_reason"] == "length" and events[-1]["generated_text"] is not None
    records = server.log_records()
    access = {r["request_id"]: r for r in records if r["logger"] == "ember.api.access"}
    for i in range(8):
        assert access[f"stream-{i}"]["fields"]["generated_tokens"] == 240
        assert access[f"stream-{i}"]["fields"]["outcome"] == "success"
    assert any("shutting down: 8 request(s) in flight" in r["message"] for r in records), records
    # after exit nothing listens
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)


def test_requests_still_running_at_the_deadline_end_with_an_error(serve):
    # 0: abort at once. A positive deadline races the generation itself: the tiny model
    # can finish 240 tokens in half a second on a fast CPU (seen on base and after).
    server = serve("--graceful-termination-timeout", "0")
    server.wait_ready()
    url = server.url
    threads, results, begun = start_streams(url, 2, max_new_tokens=240)
    plain: dict = {}

    def generate() -> None:
        body = {"inputs": "a long one", "parameters": {"max_new_tokens": 240}}
        r = httpx.post(f"{url}/generate", json=body, timeout=120)
        plain.update(status=r.status_code, body=r.json())

    plain_thread = threading.Thread(target=generate, daemon=True)
    plain_thread.start()
    for event in begun:
        assert event.wait(60)
    time.sleep(0.1)
    server.proc.send_signal(signal.SIGTERM)
    for thread in [*threads, plain_thread]:
        thread.join(60)
    assert server.proc.wait(60) == 0
    for result in results:
        events = result["events"]
        assert 0 < len(events) < 240  # cut short, and said so:
        assert events[-1]["error_type"] == "shutting_down"
        assert "graceful termination timeout 0 s" in events[-1]["error"]
    assert plain["status"] == 503 and plain["body"]["error_type"] == "shutting_down", plain
    access = [r for r in server.log_records() if r["logger"] == "ember.api.access"]
    assert sorted(r["fields"]["outcome"] for r in access if r["fields"]["path"] != "/health") == ["server_error"] * 3


def test_health_is_503_until_the_warm_up_pass_ran(tiny_llama_dir):
    from ember.api.server import create_app
    from ember.api.settings import ServerSettings
    from ember.config import EngineConfig
    from ember.engine.async_engine import AsyncLLMEngine
    from ember.engine.llm_engine import LLMEngine

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, block_size=8)))
    app = create_app(engine, ServerSettings(model_id=str(tiny_llama_dir)))
    lifecycle = app.state.lifecycle

    async def scenario() -> None:
        # the app's lifespan would start the engine and the warm-up together; here, one at a time
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ember") as client:
            engine.start()
            r = await client.get("/health")
            assert r.status_code == 503 and r.json()["error_type"] == "starting"
            steps_before = engine.num_steps
            await lifecycle.warm_up()
            assert engine.num_steps > steps_before  # a real forward pass ran
            assert (await client.get("/health")).status_code == 200
            lifecycle.begin_drain(lambda: None)
            r = await client.get("/health")
            assert r.status_code == 503 and r.json()["error_type"] == "shutting_down"

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
