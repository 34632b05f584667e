"""The TGI routes on a real uvicorn server (tiny random Llama), driven with httpx and
huggingface_hub's InferenceClient: shapes, streaming, concurrency, overload,
disconnects, and a table of bad inputs."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from server_utils import running_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=256, max_stop_sequences=4, payload_limit=100_000) as (url, app):
        yield url, app


def all_blocks_free(app) -> bool:
    stats = app.state.service.client.stats()
    return stats.num_free_blocks == stats.num_total_blocks


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


def generate(url, inputs="hello world", **parameters):
    return httpx.post(f"{url}/generate", json={"inputs": inputs, "parameters": parameters}, timeout=60)


def test_generate_and_details(server):
    url, _ = server
    r = generate(url, max_new_tokens=8, details=True)
    assert r.status_code == 200, r.text
    body = r.json()
    details = body["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 8
    assert details["seed"] is None and details["prefill"] == []
    assert len(details["tokens"]) == 8
    for token in details["tokens"]:
        assert set(token) == {"id", "text", "logprob", "special"} and token["logprob"] <= 0
    full = generate(url, max_new_tokens=8, return_full_text=True).json()["generated_text"]
    assert full == "hello world" + body["generated_text"]


def test_stream_events_concatenate_to_generated_text(server):
    url, _ = server
    for inputs in ["hello world", "multi-byte: 🙂 漢字 café"]:
        plain = generate(url, inputs, max_new_tokens=24).json()["generated_text"]
        r = httpx.post(f"{url}/generate_stream", json={"inputs": inputs, "parameters": {"max_new_tokens": 24}}, timeout=60)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert len(events) == 24
        assert all(e["generated_text"] is None for e in events[:-1])
        assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"] == plain
        assert events[-1]["details"]["finish_reason"] == "length"
        assert events[-1]["details"]["generated_tokens"] == 24


def test_stop_sequences_and_seeds(server):
    url, _ = server
    text = generate(url, "stop here", max_new_tokens=20).json()["generated_text"]
    stop = text[5:8]
    r = generate(url, "stop here", max_new_tokens=20, stop=[stop], details=True).json()
    assert r["generated_text"] == text[: text.index(stop)]
    assert r["details"]["finish_reason"] == "stop_sequence"
    a = generate(url, "seeded", max_new_tokens=12, do_sample=True, seed=42, details=True).json()
    b = generate(url, "seeded", max_new_tokens=12, do_sample=True, seed=42).json()
    assert a["generated_text"] == b["generated_text"] and a["details"]["seed"] == 42
    unseeded = generate(url, "seeded", max_new_tokens=4, temperature=0.7, details=True).json()
    assert isinstance(unseeded["details"]["seed"], int)


def test_penalties_and_typical_p_work(server):
    url, _ = server
    prompt = "hello hello hello"
    plain = generate(url, prompt, max_new_tokens=16).json()["generated_text"]
    # neutral values are the plain request
    assert generate(url, prompt, max_new_tokens=16, repetition_penalty=1.0, frequency_penalty=0.0).json() == {
        "generated_text": plain
    }
    for parameters in ({"repetition_penalty": 2.0}, {"frequency_penalty": 2.0}):
        r = generate(url, prompt, max_new_tokens=16, **parameters)
        assert r.status_code == 200, r.text
        assert r.json()["generated_text"] != plain, parameters
    # typical_p implies sampling (as in TGI): a seed is reported and reproduces the text
    a = generate(url, prompt, max_new_tokens=12, typical_p=0.5, details=True).json()
    assert isinstance(a["details"]["seed"], int)
    b = generate(url, prompt, max_new_tokens=12, typical_p=0.5, seed=a["details"]["seed"]).json()
    assert b["generated_text"] == a["generated_text"]


def test_compat_route_tokenize_info_health_models(server):
    url, _ = server
    r = httpx.post(f"{url}/", json={"inputs": "compat", "parameters": {"max_new_tokens": 5}}, timeout=60)
    assert r.status_code == 200 and isinstance(r.json()["generated_text"], str)
    r = httpx.post(f"{url}/", json={"inputs": "compat", "parameters": {"max_new_tokens": 5}, "stream": True}, timeout=60)
    assert len(sse_events(r.text)) == 5
    tokens = httpx.post(f"{url}/tokenize", json={"inputs": "hello there"}).json()
    assert "".join(t["text"] for t in tokens) == "hello there"
    assert all(t["stop"] > t["start"] for t in tokens)
    info = httpx.get(f"{url}/info").json()
    assert info["max_total_tokens"] == 256 and info["max_input_tokens"] == 255
    assert info["backend"] == "cpu" and info["model_dtype"] == "float32" and info["version"]
    assert info["prefix_caching"] is True and info["chunked_prefill"] is True
    assert 0.0 <= info["prefix_cache_hit_rate"] <= 1.0 and info["kv_cache_tokens"] == info["num_kv_blocks"] * info["kv_block_size"]
    assert httpx.get(f"{url}/health").status_code == 200
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == info["model_id"]


def test_openapi_describes_every_route(server):
    url, app = server
    spec = httpx.get(f"{url}/openapi.json").json()
    for path, method in [("/generate", "post"), ("/generate_stream", "post"), ("/", "post"), ("/tokenize", "post"),
                         ("/info", "get"), ("/health", "get"), ("/v1/models", "get"),
                         ("/v1/completions", "post"), ("/v1/chat/completions", "post")]:
        assert method in spec["paths"].get(path, {}), f"{method.upper()} {path} missing from /openapi.json"
    gen = spec["paths"]["/generate"]["post"]
    assert gen["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/GenerateRequest")
    assert "GenerateParameters" in spec["components"]["schemas"]
    assert "422" in gen["responses"] and "429" in gen["responses"]
    page = httpx.get(f"{url}/docs")
    assert page.status_code == 200 and "openapi.json" in page.text


def test_huggingface_hub_inference_client(server):
    from huggingface_hub import InferenceClient

    url, _ = server
    client = InferenceClient(base_url=url)
    out = client.text_generation("hello world", max_new_tokens=6, details=True)
    assert out.details.generated_tokens == 6 and len(out.details.tokens) == 6
    assert out.generated_text == generate(url, max_new_tokens=6).json()["generated_text"]
    pieces = list(client.text_generation("hello world", max_new_tokens=6, stream=True))
    assert "".join(pieces) == out.generated_text
    # greedy: the tiny model never picks EOS then; sampled (the default), it once stopped at 4
    chat = client.chat_completion([{"role": "user", "content": "hi"}], max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 5


def test_32_concurrent_streams_match_solo_greedy(server):
    url, app = server
    prompts = [f"concurrent prompt number {i} " + "x" * (i % 7) for i in range(32)]
    solo = [generate(url, p, max_new_tokens=16).json()["generated_text"] for p in prompts]

    async def stream(client, prompt):
        text = ""
        async with client.stream("POST", f"{url}/generate_stream",
                                 json={"inputs": prompt, "parameters": {"max_new_tokens": 16}}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    text += json.loads(line[6:])["token"]["text"]
        return text

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(stream(client, p) for p in prompts))

    assert asyncio.run(main()) == solo
    assert all_blocks_free(app)


def test_health_answers_while_a_batch_computes(server):
    url, app = server

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            long = [asyncio.create_task(client.post(f"{url}/generate", json={"inputs": "busy " * 20, "parameters": {"max_new_tokens": 200}}))
                    for _ in range(8)]
            await asyncio.sleep(0.3)
            worst = 0.0
            for _ in range(10):
                start = time.perf_counter()
                r = await client.get(f"{url}/health")
                worst = max(worst, time.perf_counter() - start)
                assert r.status_code == 200
            await asyncio.gather(*long)
            return worst

    # Not a timing assertion on performance: the loop must not be blocked for whole batches.
    assert asyncio.run(main()) < 2.0


def test_overload_gives_exactly_the_limit_and_429s(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=256, max_concurrent_requests=4) as (url, app):

        async def one(client):
            return await client.post(f"{url}/generate", json={"inputs": "long " * 10, "parameters": {"max_new_tokens": 200}})

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(one(client) for _ in range(16)))

        responses = asyncio.run(main())
        codes = sorted(r.status_code for r in responses)
        assert codes == [200] * 4 + [429] * 12
        for r in responses:
            if r.status_code == 429:
                assert r.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
            else:
                assert len(r.json()["generated_text"]) > 0
        assert generate(url, max_new_tokens=3).status_code == 200


def test_disconnected_streams_free_their_blocks(server):
    url, app = server

    async def cut(client, i):
        async with client.stream("POST", f"{url}/generate_stream",
                                 json={"inputs": f"cut {i}", "parameters": {"max_new_tokens": 200}}) as r:
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:
                        return  # leaving the block closes the connection mid-stream

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(cut(client, i) for i in range(20)))

    asyncio.run(main())
    deadline = time.time() + 10
    while time.time() < deadline and (not all_blocks_free(app) or app.state.service.num_in_flight):
        time.sleep(0.05)
    assert all_blocks_free(app)
    assert app.state.service.num_in_flight == 0
    assert httpx.get(f"{url}/health").status_code == 200


def _post(url, path, content, headers=None):
    return httpx.post(f"{url}{path}", content=content, headers=headers or {"content-type": "application/json"}, timeout=60)


J = json.dumps
BAD_INPUTS = [
    # (name, path, raw body, headers, status, error_type)
    ("malformed json", "/generate", b'{"inputs": "x"', None, 400, "bad_request"),
    ("not utf-8", "/generate", b'{"inputs": "\xff\xfe"}', None, 400, "bad_request"),
    ("empty body", "/generate", b"", None, 400, "bad_request"),
    ("body is a list", "/generate", J(["x"]).encode(), None, 422, "validation"),
    ("missing inputs", "/generate", J({"parameters": {}}).encode(), None, 422, "validation"),
    ("inputs not a string", "/generate", J({"inputs": 5}).encode(), None, 422, "validation"),
    ("inputs null", "/generate", J({"inputs": None}).encode(), None, 422, "validation"),
    ("empty inputs", "/generate", J({"inputs": ""}).encode(), None, 422, "validation"),
    ("unknown top-level field", "/generate", J({"inputs": "x", "foo": 1}).encode(), None, 422, "validation"),
    ("unknown parameter", "/generate", J({"inputs": "x", "parameters": {"bogus": 1}}).encode(), None, 422, "validation"),
    ("parameters not an object", "/generate", J({"inputs": "x", "parameters": 3}).encode(), None, 422, "validation"),
    ("max_new_tokens string", "/generate", J({"inputs": "x", "parameters": {"max_new_tokens": "5"}}).encode(), None, 422, "validation"),
    ("max_new_tokens zero", "/generate", J({"inputs": "x", "parameters": {"max_new_tokens": 0}}).encode(), None, 422, "validation"),
    ("max_new_tokens negative", "/generate", J({"inputs": "x", "parameters": {"max_new_tokens": -4}}).encode(), None, 422, "validation"),
    ("max_new_tokens huge", "/generate", J({"inputs": "x", "parameters": {"max_new_tokens": 10**12}}).encode(), None, 422, "validation"),
    ("max_new_tokens float", "/generate", J({"inputs": "x", "parameters": {"max_new_tokens": 2.5}}).encode(), None, 422, "validation"),
    ("temperature zero", "/generate", J({"inputs": "x", "parameters": {"temperature": 0}}).encode(), None, 422, "validation"),
    ("temperature negative", "/generate", J({"inputs": "x", "parameters": {"temperature": -1.0}}).encode(), None, 422, "validation"),
    ("top_p one", "/generate", J({"inputs": "x", "parameters": {"top_p": 1.0}}).encode(), None, 422, "validation"),
    ("top_k zero", "/generate", J({"inputs": "x", "parameters": {"top_k": 0}}).encode(), None, 422, "validation"),
    ("seed negative", "/generate", J({"inputs": "x", "parameters": {"seed": -1}}).encode(), None, 422, "validation"),
    ("seed too big", "/generate", J({"inputs": "x", "parameters": {"seed": 2**70}}).encode(), None, 422, "validation"),
    ("do_sample not bool", "/generate", J({"inputs": "x", "parameters": {"do_sample": "yes"}}).encode(), None, 422, "validation"),
    ("stop not a list", "/generate", J({"inputs": "x", "parameters": {"stop": "a"}}).encode(), None, 422, "validation"),
    ("too many stops", "/generate", J({"inputs": "x", "parameters": {"stop": ["a", "b", "c", "d", "e"]}}).encode(), None, 422, "validation"),
    ("prompt too long", "/generate", J({"inputs": "x" * 400}).encode(), None, 422, "validation"),
    ("truncate too big", "/generate", J({"inputs": "x", "parameters": {"truncate": 10_000}}).encode(), None, 422, "validation"),
    ("grammar of no known type", "/generate", J({"inputs": "x", "parameters": {"grammar": {"type": "xml", "value": {}}}}).encode(), None, 400, "bad_request"),
    ("watermark bad gamma", "/generate", J({"inputs": "x", "parameters": {"watermark": True, "extra": {"watermark": {"gamma": 2}}}}).encode(), None, 422, "validation"),
    ("best_of greedy", "/generate", J({"inputs": "x", "parameters": {"best_of": 2}}).encode(), None, 422, "validation"),
    ("best_of streamed", "/generate_stream", J({"inputs": "x", "parameters": {"best_of": 2, "do_sample": True}}).encode(), None, 422, "validation"),
    ("best_of too many", "/generate", J({"inputs": "x", "parameters": {"best_of": 17, "do_sample": True}}).encode(), None, 422, "validation"),
    ("top_n_tokens 6", "/generate", J({"inputs": "x", "parameters": {"top_n_tokens": 6}}).encode(), None, 422, "validation"),
    ("top_n_tokens huge", "/generate", J({"inputs": "x", "parameters": {"top_n_tokens": 10**12}}).encode(), None, 422, "validation"),
    ("top_n_tokens negative", "/generate", J({"inputs": "x", "parameters": {"top_n_tokens": -1}}).encode(), None, 422, "validation"),
    ("top_n_tokens string", "/generate", J({"inputs": "x", "parameters": {"top_n_tokens": "3"}}).encode(), None, 422, "validation"),
    ("decoder_input_details not bool", "/generate", J({"inputs": "x", "parameters": {"decoder_input_details": "yes"}}).encode(), None, 422, "validation"),
    ("decoder_input_details streamed", "/generate_stream", J({"inputs": "x", "parameters": {"decoder_input_details": True}}).encode(), None, 422, "validation"),
    ("adapter_id with adapters off", "/generate", J({"inputs": "x", "parameters": {"adapter_id": "lora"}}).encode(), None, 404, "adapter_not_found"),
    ("repetition_penalty zero", "/generate", J({"inputs": "x", "parameters": {"repetition_penalty": 0}}).encode(), None, 422, "validation"),
    ("repetition_penalty negative", "/generate", J({"inputs": "x", "parameters": {"repetition_penalty": -1.5}}).encode(), None, 422, "validation"),
    ("typical_p 1.5", "/generate", J({"inputs": "x", "parameters": {"typical_p": 1.5}}).encode(), None, 422, "validation"),
    ("typical_p one", "/generate", J({"inputs": "x", "parameters": {"typical_p": 1.0}}).encode(), None, 422, "validation"),
    ("frequency_penalty 3", "/generate", J({"inputs": "x", "parameters": {"frequency_penalty": 3.0}}).encode(), None, 422, "validation"),
    ("extra names a built-in", "/generate", J({"inputs": "x", "parameters": {"extra": {"top_k": 2}}}).encode(), None, 422, "validation"),
    ("extra names no processor", "/generate", J({"inputs": "x", "parameters": {"extra": {"no_such": True}}}).encode(), None, 422, "validation"),
    ("extra not an object", "/generate", J({"inputs": "x", "parameters": {"extra": ["ban_digits"]}}).encode(), None, 422, "validation"),
    ("10 MB body", "/generate", b'{"inputs": "' + b"x" * 10_000_000 + b'"}', None, 413, "payload_too_large"),
    ("text/plain content type", "/generate", J({"inputs": "x"}).encode(), {"content-type": "text/plain"}, 415, "unsupported_media_type"),
    ("form content type", "/generate_stream", b"inputs=x", {"content-type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
    ("stream: bad parameter", "/generate_stream", J({"inputs": "x", "parameters": {"top_k": -3}}).encode(), None, 422, "validation"),
    ("compat: stream not bool", "/", J({"inputs": "x", "stream": "true"}).encode(), None, 422, "validation"),
    ("tokenize: missing inputs", "/tokenize", J({}).encode(), None, 422, "validation"),
]


@pytest.mark.parametrize("name, path, body, headers, status, error_type", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_its_status_and_json_body(server, name, path, body, headers, status, error_type):
    url, _ = server
    r = _post(url, path, body, headers)
    assert r.status_code == status, r.text
    payload = r.json()
    assert set(payload) == {"error", "error_type"} and payload["error_type"] == error_type
    assert isinstance(payload["error"], str) and payload["error"]
    # the server still serves the next request
    assert generate(url, max_new_tokens=2).status_code == 200


def test_unknown_route_and_method_are_json(server):
    url, _ = server
    r = httpx.get(f"{url}/nope")
    assert r.status_code == 404 and r.json()["error_type"] == "not_found"
    r = httpx.get(f"{url}/generate")
    assert r.status_code == 405 and r.json()["error_type"] == "method_not_allowed"


def test_a_failing_step_becomes_an_error_event_and_the_server_lives_on(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=256) as (url, app):
        runner = app.state.service.client.engine.runner  # a fault planted inside the engine
        real_execute = runner.execute
        calls = {"n": 0}

        def flaky(scheduler_output):
            calls["n"] += 1
            if calls["n"] == 3:  # mid-stream: after the prefill and one decode step
                raise RuntimeError("simulated device failure")
            return real_execute(scheduler_output)

        runner.execute = flaky
        r = httpx.post(f"{url}/generate_stream", json={"inputs": "doomed", "parameters": {"max_new_tokens": 20}}, timeout=60)
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1]["error_type"] == "generation" and "simulated device failure" in events[-1]["error"]
        assert all("token" in e for e in events[:-1])
        runner.execute = real_execute
        assert generate(url, max_new_tokens=3).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200
        assert all_blocks_free(app)


def test_top_tokens_and_prefill(server):
    """`top_n_tokens` and `decoder_input_details` as TGI shapes them; logprobs are of
    the distribution each token was drawn from (greedy here: the model's own)."""
    url, app = server
    client = app.state.service.client
    r = generate(url, "hello world", max_new_tokens=5, details=True, decoder_input_details=True, top_n_tokens=3)
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    prompt_ids = client.encode("hello world")
    assert [t["id"] for t in details["prefill"]] == prompt_ids
    assert details["prefill"][0]["logprob"] is None
    assert all(t["logprob"] <= 0 for t in details["prefill"][1:])
    assert len(details["top_tokens"]) == len(details["tokens"]) == 5
    for token, top in zip(details["tokens"], details["top_tokens"]):
        assert len(top) == 3 and all(set(t) == {"id", "text", "logprob", "special"} for t in top)
        logprobs = [t["logprob"] for t in top]
        assert logprobs == sorted(logprobs, reverse=True)
        assert top[0]["id"] == token["id"] and top[0]["logprob"] == pytest.approx(token["logprob"])
    events = sse_events(httpx.post(
        f"{url}/generate_stream", json={"inputs": "hello world", "parameters": {"max_new_tokens": 5, "top_n_tokens": 2}},
        timeout=60,
    ).text)
    assert [[t["id"] for t in e["top_tokens"]] for e in events] == [[t["id"] for t in top[:2]] for top in details["top_tokens"]]
    plain = generate(url, "hello world", max_new_tokens=2, details=True).json()["details"]
    assert plain["prefill"] == [] and plain["top_tokens"] == []


def test_inference_client_parses_prefill_and_top_tokens(server):
    from huggingface_hub import InferenceClient

    url, _ = server
    client = InferenceClient(base_url=url)
    out = client.text_generation(
        "hello world", max_new_tokens=4, details=True, decoder_input_details=True, top_n_tokens=3
    )
    assert out.details.prefill[0].logprob is None and out.details.prefill[1].logprob <= 0
    assert len(out.details.top_tokens) == 4 and all(len(top) == 3 for top in out.details.top_tokens)
    # huggingface_hub leaves the nested top_tokens lists as dicts (its parser does not
    # descend into lists of lists); both spellings are TGI's Token
    first = out.details.top_tokens[0][0]
    assert (first["id"] if isinstance(first, dict) else first.id) == out.details.tokens[0].id
    streamed = list(client.text_generation("hello world", max_new_tokens=3, stream=True, details=True, top_n_tokens=2))
    assert all(len(event.top_tokens) == 2 for event in streamed)


def test_best_of_returns_the_highest_mean_logprob_and_the_others(server):
    url, _ = server
    r = generate(url, "best of", max_new_tokens=8, best_of=3, do_sample=True, seed=21, details=True)
    assert r.status_code == 200, r.text
    body = r.json()
    others = body["details"]["best_of_sequences"]
    assert len(others) == 2
    def mean(d):
        return sum(t["logprob"] for t in d["tokens"]) / len(d["tokens"])
    assert all(mean(body["details"]) >= mean(o) for o in others)
    # each sequence reports the seed that reproduces it alone
    for seq in [body["details"], *others]:
        alone = generate(url, "best of", max_new_tokens=8, do_sample=True, seed=seq["seed"]).json()["generated_text"]
        text = body["generated_text"] if seq is body["details"] else seq["generated_text"]
        assert alone == text
