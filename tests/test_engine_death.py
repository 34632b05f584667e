"""The engine-core process dies under saturation (issue 35 item 3): `ember serve` in a
subprocess on the tiny model, 16 streams and 8 plain requests running on every API,
then SIGKILL (or SIGSEGV) to the core. /health must turn 503 within 1 s, every stream
must end with an error event in its API's shape, every plain request with a 503 JSON
error, new requests get 503 with a message, and the server exits non-zero well within
--graceful-termination-timeout (what an orchestrator restarts)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

import httpx
import pytest
from serve_subprocess import served
from tiny_models import with_context

MAX_TOKENS = 1500  # far more than the seconds before the kill can generate: every request is in flight
SERVE_ARGS = ("--max-total-tokens", "2048", "--max-batch-total-tokens", "65536", "--max-batch-size", "32",
              "--graceful-termination-timeout", "20", "--log-level", "info")
MESSAGES = [{"role": "user", "content": "Tell me a long story"}]

# (route, body) of each API, greedy (the tiny model then never ends early: EOS has an all-zero output row);
# streams add their own "stream" flag
ROUTES = {
    "chat": ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}),
    "completions": ("/v1/completions", {"model": "m", "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
                                        "temperature": 0}),
    "tgi": ("/generate", {"inputs": "Once upon a time", "parameters": {"max_new_tokens": MAX_TOKENS}}),
    "anthropic": ("/v1/messages", {"model": "m", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}),
    "responses": ("/v1/responses", {"model": "m", "input": "Tell me a long story", "max_output_tokens": MAX_TOKENS,
                                 "temperature": 0}),
}


@dataclass
class Outcome:
    api: str
    is_stream: bool
    status: int | None = None
    first_event_at: float | None = None
    ended_at: float | None = None
    events: list[str] = field(default_factory=list)  # the data lines (streams) or the body (plain)


async def _stream(client: httpx.AsyncClient, api: str, outcome: Outcome, started: asyncio.Event) -> None:
    path, body = ROUTES[api]
    if api == "tgi":  # TGI streams on a route of its own
        path = "/generate_stream"
    else:
        body = {**body, "stream": True}
    async with client.stream("POST", path, json=body) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            outcome.events.append((await response.aread()).decode())
            started.set()
        async for line in response.aiter_lines():
            if line.startswith("data:") or line.startswith("event:"):
                outcome.events.append(line)
                if outcome.first_event_at is None and line.startswith("data:"):
                    outcome.first_event_at = time.monotonic()
                    started.set()
    outcome.ended_at = time.monotonic()


async def _plain(client: httpx.AsyncClient, api: str, outcome: Outcome) -> None:
    path, body = ROUTES[api]
    response = await client.post(path, json=body)
    outcome.status, outcome.ended_at = response.status_code, time.monotonic()
    outcome.events.append(response.text)


def _last_data(outcome: Outcome) -> dict | None:
    for line in reversed(outcome.events):
        if line.startswith("data:") and line != "data: [DONE]":
            return json.loads(line[5:])
    return None


def _is_error_event(outcome: Outcome) -> bool:
    """The stream's last event is an error in its API's shape."""
    last = _last_data(outcome)
    if last is None:
        return False
    if outcome.api == "tgi":  # {"error": message, "error_type": type}
        return isinstance(last.get("error"), str) and last.get("error_type") == "unhealthy"
    if outcome.api == "anthropic":  # event: error, {"type": "error", "error": {"type", "message"}}
        return last.get("type") == "error" and "message" in last.get("error", {}) and "event: error" in outcome.events
    if outcome.api == "responses":  # response.failed with the error, or an error event
        response = last.get("response") or {}
        return last.get("type") in ("response.failed", "error") and (response.get("error") or last.get("message"))
    error = last.get("error")  # OpenAI chat and completions: {"error": {"message", "type", ...}}
    return isinstance(error, dict) and bool(error.get("message"))


async def _saturate_and_kill(url: str, core_pid: int, sig: int) -> dict:
    """16 streams and 8 plain requests on all five APIs, then ``sig`` to the core; /health
    polled every 50 ms. Returns the timings and every outcome."""
    apis = list(ROUTES)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60), limits=limits) as client:
        streams = [Outcome(apis[i % 5], True) for i in range(16)]
        plains = [Outcome(apis[i % 5], False) for i in range(8)]
        events = [asyncio.Event() for _ in streams]
        tasks = [asyncio.create_task(_stream(client, o.api, o, e)) for o, e in zip(streams, events)]
        tasks += [asyncio.create_task(_plain(client, o.api, o)) for o in plains]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)  # every stream is generating
        except TimeoutError:
            raise AssertionError(f"not every stream started: {[(o.api, o.status, o.events[:2]) for o in streams]}")
        await asyncio.sleep(0.3)
        ended = [(o.api, o.is_stream, o.status, o.events[-1:]) for o in streams + plains if o.ended_at is not None]
        assert not ended, f"requests ended before the kill: {ended}"
        health_before = (await client.get("/health")).status_code
        killed_at = time.monotonic()
        os.kill(core_pid, sig)
        unhealthy_at = None
        while unhealthy_at is None and time.monotonic() - killed_at < 10:
            try:
                if (await client.get("/health", timeout=2)).status_code == 503:
                    unhealthy_at = time.monotonic()
            except httpx.HTTPError:  # the server already closed its socket: unhealthy too
                unhealthy_at = time.monotonic()
            await asyncio.sleep(0.05)
        new_request = None
        try:
            new_request = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
        except httpx.HTTPError:  # the server stopped listening before this request: also a refusal
            pass
        done, pending = await asyncio.wait(tasks, timeout=30)
        still_open = [(o.api, o.is_stream, o.status, o.events[-2:]) for o in streams + plains if o.ended_at is None]
        assert not pending, f"requests still open 30 s after the kill: {still_open}"
        for task in done:
            task.result()
    return {"health_before": health_before, "killed_at": killed_at, "unhealthy_at": unhealthy_at,
            "new_request": new_request, "streams": streams, "plains": plains}


@pytest.fixture(scope="module")
def long_tiny(tiny_llama_dir, tmp_path_factory):
    return with_context(tiny_llama_dir, tmp_path_factory.mktemp("long") / "model", 4096)


def _assert_every_client_heard(result: dict, label: str) -> None:
    """/health 503 within 1 s of the kill; every stream ended with an error event in its
    API's shape and every plain request with a 503 naming the engine, within 5 s."""
    killed_at = result["killed_at"]
    assert result["health_before"] == 200
    assert result["unhealthy_at"] is not None, "/health never turned 503"
    health_latency = result["unhealthy_at"] - killed_at
    slowest = max(o.ended_at for o in result["streams"] + result["plains"]) - killed_at
    print(f"\n{label}: /health 503 after {health_latency * 1000:.0f} ms; every client had its error "
          f"{slowest:.2f} s after the kill")
    assert health_latency < 1.0, f"/health turned 503 {health_latency:.2f} s after the kill"
    for outcome in result["streams"]:
        assert outcome.status == 200, outcome
        assert _is_error_event(outcome), f"{outcome.api} stream did not end with an error event: {outcome.events[-3:]}"
        assert outcome.ended_at - killed_at < 5, f"{outcome.api} stream ended {outcome.ended_at - killed_at:.1f} s late"
    for outcome in result["plains"]:
        assert outcome.status == 503, f"{outcome.api}: {outcome.status} {outcome.events}"
        assert outcome.ended_at - killed_at < 5, f"{outcome.api} answered {outcome.ended_at - killed_at:.1f} s late"
        assert "engine" in outcome.events[0], outcome.events[0]  # the message says why


def _wait_exit(server, timeout: float = 30) -> int:
    try:
        return server.process.wait(timeout)  # well within --graceful-termination-timeout 20 + uvicorn's 5
    except subprocess.TimeoutExpired:
        log = server.log()[-3000:]
        raise AssertionError(f"the server still runs {timeout} s after the kill; its log:\n{log}") from None


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV], ids=["sigkill", "sigsegv"])
def test_the_core_dies_under_load_and_every_client_hears_of_it(long_tiny, sig):
    with served(long_tiny, *SERVE_ARGS) as server:
        result = asyncio.run(_saturate_and_kill(server.url, server.core_pid(), sig))
        exit_code = _wait_exit(server)
        exited_at = time.monotonic()
        log = server.log()
    _assert_every_client_heard(result, signal.Signals(sig).name)
    killed_at = result["killed_at"]
    print(f"server exited {exit_code} after {exited_at - killed_at:.2f} s")
    for api in ROUTES:  # one stream's last event per API, for the log
        print(api, next(o.events[-1] for o in result["streams"] if o.api == api)[:200])
    new = result["new_request"]
    if new is not None:  # or the server no longer listened: a refusal too
        assert new.status_code == 503 and "engine-core process exited" in new.json()["error"]["message"], new.text
    assert exit_code != 0
    assert exited_at - killed_at < 20, f"the server took {exited_at - killed_at:.1f} s to exit"
    assert "the engine stopped" in log and f"killed by {signal.Signals(sig).name}" in log


def _wait_healthy_again(url: str, timeout: float = 90) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if httpx.get(f"{url}/health", timeout=5).status_code == 200:
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"/health not 200 again within {timeout} s of the restart")


def test_restart_engine_on_failure_replaces_the_core_in_place_within_its_bound(long_tiny):
    args = (*SERVE_ARGS, "--restart-engine-on-failure", "--max-engine-restarts", "1")
    with served(long_tiny, *args) as server:
        first_core = server.core_pid()
        result = asyncio.run(_saturate_and_kill(server.url, first_core, signal.SIGKILL))
        _assert_every_client_heard(result, "SIGKILL, restart on")
        new = result["new_request"]  # sent as soon as /health said 503: the new core is still loading
        assert new.status_code == 503 and "restarting" in new.json()["error"]["message"], new.text
        healthy_at = _wait_healthy_again(server.url)
        print(f"healthy again {healthy_at - result['killed_at']:.1f} s after the kill")
        assert server.process.poll() is None
        second_core = server.core_pid()
        assert second_core != first_core
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 5,
                                                              "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert "ember_engine_restarts_total 1.0" in metrics
        # past the bound (1 restart an hour) the server stops as without the flag
        killed_at = time.monotonic()
        os.kill(second_core, signal.SIGKILL)
        exit_code = _wait_exit(server)
        log = server.log()
    assert exit_code != 0
    print(f"second death: server exited {exit_code} after {time.monotonic() - killed_at:.1f} s")
    assert "ERROR" in log and "restarting it (restart 1" in log and "killed by SIGKILL" in log
    assert "no restart left" in log


def test_the_restart_flag_is_refused_in_thread_mode():
    from ember.api.settings import ServerSettings

    with pytest.raises(ValueError, match="--restart-engine-on-failure needs --engine-mode process"):
        ServerSettings(engine_mode="thread", restart_engine_on_failure=True)
    with pytest.raises(ValueError, match="--max-engine-restarts must be an integer >= 0"):
        ServerSettings(max_engine_restarts=-1)


def test_a_step_that_raises_in_the_core_process_fails_its_requests_and_the_core_serves_on(tiny_llama_dir):
    """The loop the engine-core process runs (`_serve`), here over a real pipe with a real
    core whose next step raises once (a bug, not a death): the requests of that step get
    ``step_failed``, the core stays up and serves the next request to its end."""
    import multiprocessing
    import threading

    from ember import SamplingParams
    from ember.config import EngineConfig
    from ember.engine.core import EngineCore, EngineCoreRequest
    from ember.engine.core_process import _serve

    core = EngineCore(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, block_size=8))
    real_step = core.step
    calls = {"n": 0}

    def step_that_raises_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second step: the request is running
            raise RuntimeError("a bug in a step")
        return real_step(*args, **kwargs)

    core.step = step_that_raises_once
    parent, child = multiprocessing.Pipe()
    loop = threading.Thread(target=_serve, args=(core, child), daemon=True)
    loop.start()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    try:
        parent.send(("add", EngineCoreRequest("a", [5, 6, 7], params)))
        messages = []
        while not messages or messages[-1][0] != "step_failed":
            assert parent.poll(30), f"no step_failed; got {[m[0] for m in messages]}"
            messages.append(parent.recv())
        assert "a bug in a step" in messages[-1][1] and messages[-1][2] == ["a"]
        parent.send(("add", EngineCoreRequest("b", [5, 6, 7], params)))
        tokens = []
        while len(tokens) < 6:
            assert parent.poll(30), "the core stopped serving after a failed step"
            kind, *rest = parent.recv()
            if kind == "outputs":
                tokens += [t for out in rest[0].outputs if out.request_id == "b" for t in out.new_token_ids]
        assert len(tokens) == 6
    finally:
        parent.send(("shutdown",))
        loop.join(10)
        core.close()
