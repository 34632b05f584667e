"""`priority` on the HTTP routes: with one request running at a time, an urgent request
preempts a long low-priority stream and finishes first; at equal priority it waits."""

import threading
import time

import httpx
import pytest

from server_utils import running_server

BLOCKER_TOKENS = 240


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # max_num_seqs=1: the running batch holds one request, so order is all priority
    with running_server(tiny_llama_dir, engine={"max_num_seqs": 1}, max_total_tokens=256) as srv:
        yield srv.url


def run_blocker(url: str, priority: int, started: threading.Event, result: dict) -> None:
    body = {"inputs": "once upon a time", "parameters": {"max_new_tokens": BLOCKER_TOKENS, "priority": priority}}
    count = 0
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                count += 1
                if count == 3:
                    started.set()
    result["done_at"] = time.monotonic()
    result["events"] = count


def urgent_request(url: str, route: str, priority: int) -> tuple[httpx.Response, float]:
    if route == "tgi":
        response = httpx.post(
            f"{url}/generate", json={"inputs": "quick", "parameters": {"max_new_tokens": 4, "priority": priority}}, timeout=60
        )
    else:
        response = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": "quick", "max_tokens": 4, "temperature": 0, "priority": priority},
            timeout=60,
        )
    return response, time.monotonic()


@pytest.mark.parametrize("route", ["tgi", "openai"])
@pytest.mark.parametrize("urgent_priority, overtakes", [(0, True), (10, False)])
def test_an_urgent_request_overtakes_a_long_low_priority_stream(server, route, urgent_priority, overtakes):
    started, result = threading.Event(), {}
    blocker = threading.Thread(target=run_blocker, args=(server, 10, started, result))
    blocker.start()
    assert started.wait(30)
    response, urgent_done_at = urgent_request(server, route, urgent_priority)
    blocker.join(60)
    assert response.status_code == 200, response.text
    # the preempted stream resumes and still delivers every token (+1: the final event)
    assert result["events"] == BLOCKER_TOKENS
    assert (urgent_done_at < result["done_at"]) is overtakes


@pytest.mark.parametrize("priority", ["high", 1.5, True, 2**40, None])
def test_a_bad_priority_is_a_422_naming_it(server, priority):
    response = httpx.post(f"{server}/generate", json={"inputs": "x", "parameters": {"priority": priority}})
    assert response.status_code == 422, response.text
    assert "priority" in response.json()["error"]
    response = httpx.post(
        f"{server}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, "priority": priority}
    )
    if priority is None:  # on the OpenAI routes null means the default, for every field
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 422, response.text
    assert "priority" in response.json()["error"]["message"]
