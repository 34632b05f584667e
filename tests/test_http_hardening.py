"""Issue 12's HTTP items one by one, on a real uvicorn server (tiny random Llama):
strict JSON, the body read within its timeout and outside the in-flight count, the
drain answering stalled uploads, client disconnects counted apart, tokenizing off
the event loop behind a characters bound, /tokenize capped, tiny temperatures greedy,
finite logits, watermark bounds, OpenAPI listing every route, messages showing values.
The hostile-client table (test_hostile_clients.py) runs all of them together."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import socket
import threading
import time

import httpx
import pytest
import torch
from server_utils import running_server, wait_idle
from test_hostile_clients import request_head, strict_json
from test_shutdown import Serve

from ember.api.errors import APIError
from ember.api.http import MAX_JSON_DEPTH, json_depth, parse_json

BIG = "x" * 1_900_000


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=256, payload_limit=2_000_000, request_body_timeout=1.0) as s:
        yield s


# -- strict JSON ----------------------------------------------------------------------


@pytest.mark.parametrize("body, words", [
    (b'{"a": NaN}', "NaN is not a JSON number"),
    (b'{"a": Infinity}', "Infinity is not a JSON number"),
    (b'{"a": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"a": 1e400}', "overflows to infinity"),
    (b'{"a": -2.5e999}', "overflows to infinity"),
    (b'{"a": ' + b"7" * 5000 + b"}", "5000 digits"),
    (b'{"a": -' + b"1" * 41 + b"}", "41 digits"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), f"nested {MAX_JSON_DEPTH + 1} levels deep"),
    (b'{"a": "x\\ud800y"}', "lone UTF-16 surrogate"),
    (b'{"\\udc00": 1}', "lone UTF-16 surrogate"),
    (b'{"a": "\xff"}', "not valid UTF-8"),
    (b'{"a": 1,}', "malformed JSON"),
])
def test_parse_json_refuses_what_strict_json_does_not_allow(body, words):
    with pytest.raises(APIError) as info:
        parse_json(body)
    assert info.value.status == 400 and words in info.value.message


def test_parse_json_accepts_the_edges_of_strict_json():
    assert parse_json(b'{"a": 1.7976931348623157e308, "b": -' + b"9" * 40 + b"}")["a"] == 1.7976931348623157e308
    assert parse_json(b'["\\ud83d\\ude00", "[[[{{{\\"", "\\\\ud800"]') == ["\U0001F600", '[[[{{{"', "\\ud800"]
    depth = MAX_JSON_DEPTH
    assert parse_json(b"[" * depth + b"]" * depth) is not None
    assert json_depth(json.dumps({"s": "[" * 1000, "t": ["{" * 500]}).encode()) == 2


def test_a_5000_digit_integer_and_deep_nesting_are_400_over_http(server):
    url, _ = server
    for path, body in [
        ("/generate", b'{"inputs": "x", "parameters": {"seed": ' + b"9" * 5000 + b"}}"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
        ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000),
        ("/watermark/detect", b'{"text": "x", "gamma": NaN}'),
    ]:
        r = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (path, r.text)
        strict_json(r.text)


# -- the body: timeout, in flight, drain, disconnects --------------------------------------


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_a_stalled_upload_gets_408_and_is_never_in_flight(server):
    url, app = server
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=10) as sock:
        sock.sendall(request_head("/generate", 100) + b'{"inputs": ')
        time.sleep(0.5)
        assert app.state.lifecycle.num_active == 0 and app.state.service.num_in_flight == 0
        response = b""
        started = time.monotonic()
        while chunk := sock.recv(65536):
            response += chunk
        waited = time.monotonic() - started
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"connection: close" in head.lower()
    payload = json.loads(body)
    assert payload["error_type"] == "request_timeout" and "--request-body-timeout" in payload["error"]
    assert waited < 3  # the 1 s timeout, not the client's patience
    assert httpx.post(f"{url}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_a_client_gone_mid_upload_is_cancelled_not_a_server_error(server, caplog):
    url, app = server
    metrics = app.state.metrics
    before = metrics.requests.labels("/generate", "cancelled", "client_disconnected")._value.get()
    with caplog.at_level(logging.INFO, logger="ember"):
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=10) as sock:
            sock.sendall(request_head("/generate", 1000) + b'{"inputs": "half')
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while metrics.requests.labels("/generate", "cancelled", "client_disconnected")._value.get() == before:
            assert time.monotonic() < deadline, "the disconnect was never counted"
            time.sleep(0.02)
        wait_idle(app)
    records = [r for r in caplog.records if r.name == "ember.api.access" and r.fields["status"] == 499]
    assert records and all(r.levelno == logging.INFO and r.exc_info is None for r in records)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    assert "Traceback" not in caplog.text and "ClientDisconnect" not in caplog.text
    assert metrics.requests.labels("/generate", "server_error", "internal")._value.get() == 0
    assert 'outcome="cancelled"' in httpx.get(f"{url}/metrics").text


def test_sigterm_answers_stalled_uploads_at_once_and_exits(tiny_llama_dir, tmp_path):
    """Headers, then no body: such connections are not in flight, so the drain does not
    wait for them; their body wait ends with a 503 as the drain begins."""
    server = Serve(tiny_llama_dir, tmp_path / "serve.log", "--request-body-timeout", "120",
                   "--graceful-termination-timeout", "30")
    try:
        server.wait_ready()
        socks = [socket.create_connection(("127.0.0.1", server.port), timeout=20) for _ in range(3)]
        for sock in socks:
            sock.sendall(request_head("/v1/completions", 500) + b'{"model": ')
        half_headers = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        half_headers.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")  # never finished
        time.sleep(0.5)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        for sock in socks:
            response = b""
            while chunk := sock.recv(65536):
                response += chunk
            sock.close()
            head, _, body = response.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503"), response
            assert json.loads(body)["error"]["code"] == "shutting_down"
        assert server.proc.wait(20) == 0
        assert time.monotonic() - started < 10  # not the 30 s graceful timeout, nor the 120 s body timeout
        assert half_headers.recv(65536) == b""  # closed by uvicorn at shutdown, without an answer
        half_headers.close()
    finally:
        server.stop()


# -- off the event loop, and bounded --------------------------------------------------------


def test_health_answers_within_a_second_while_a_huge_prompt_is_tokenized(server, monkeypatch):
    url, app = server
    service = app.state.service
    threads = []
    encode = service.encode

    def recording_encode(text, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(service, "encode", recording_encode)

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            big = asyncio.create_task(client.post("/generate", json={
                "inputs": BIG, "parameters": {"truncate": 8, "max_new_tokens": 2}}))
            slowest = 0.0
            while not big.done():
                start = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                slowest = max(slowest, time.perf_counter() - start)
                await asyncio.sleep(0.05)
            return await big, slowest

    response, slowest = asyncio.run(main())
    assert response.status_code == 200, response.text
    assert threads and all(name.startswith("ember-prepare") for name in threads), threads
    assert slowest < 1.0, f"/health took {slowest:.2f} s while 1.9 MB were tokenized"


@pytest.mark.parametrize("path, body, param", [
    ("/generate", {"inputs": BIG}, "inputs"),
    ("/generate_stream", {"inputs": BIG}, "inputs"),
    ("/tokenize", {"inputs": BIG}, "inputs"),
    ("/v1/completions", {"model": "m", "prompt": BIG}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": ["ok", BIG]}, "prompt[1]"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": BIG}]}, "messages"),
    ("/watermark/detect", {"text": BIG}, "text"),
])
def test_a_prompt_too_long_by_its_characters_is_refused_without_tokenizing(server, monkeypatch, path, body, param):
    url, app = server
    service = app.state.service
    calls = []
    monkeypatch.setattr(service.tokenizer, "encode", lambda *a, **k: calls.append(a) or [])
    monkeypatch.setattr(service.tokenizer, "apply_chat_template", lambda *a, **k: calls.append(a) or "")
    r = httpx.post(f"{url}{path}", json=body, timeout=30)
    assert r.status_code == 422, r.text
    assert "characters are more than that many tokens can hold" in r.text and param in r.text
    assert calls == []


def test_tokenize_is_capped_by_the_input_limit_and_honours_truncate(server):
    url, app = server
    max_input = app.state.service.limits.max_input_tokens
    r = httpx.post(f"{url}/tokenize", json={"inputs": "y" * (max_input + 1)})
    assert r.status_code == 422 and f"at most {max_input} tokens. Given: {max_input + 1}" in r.text
    r = httpx.post(f"{url}/tokenize", json={"inputs": "y" * max_input})
    assert r.status_code == 200 and len(r.json()) == max_input
    r = httpx.post(f"{url}/tokenize", json={"inputs": "ab" * 300_000, "parameters": {"truncate": 3}}, timeout=60)
    tokens = r.json()
    assert r.status_code == 200 and len(tokens) == 3
    assert [(t["start"], t["stop"]) for t in tokens] == [(599_997, 599_998), (599_998, 599_999), (599_999, 600_000)]
    assert "".join(t["text"] for t in tokens) == "bab"


def test_max_chars_per_token_bounds_every_tokenization(tiny_llama_dir):
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from transformers import AutoTokenizer

    from ember.models.tokenizer import max_chars_per_token

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    bound = max_chars_per_token(tokenizer)
    assert bound == max(len(t) for t in tokenizer.get_vocab())

    @settings(max_examples=200, deadline=None)
    @given(st.text(min_size=1, max_size=200))
    def holds(text):
        assert len(text) <= bound * len(tokenizer.encode(text, add_special_tokens=False))

    holds()
    holds_for = lambda text: len(text) <= bound * len(tokenizer.encode(text, add_special_tokens=False))
    assert holds_for("<|im_start|>" * 10) and holds_for(" " * 1000) and holds_for("\U0001F600" * 50)


def test_max_chars_per_token_is_none_where_a_token_can_swallow_any_text():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ember.models.tokenizer import max_chars_per_token

    def fast(model, normalizer=None, pre_tokenizer=None):
        tok = Tokenizer(model)
        if normalizer is not None:
            tok.normalizer = normalizer
        tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=tok)

    vocab = {"[UNK]": 0, "a": 1, "ab": 2}
    assert max_chars_per_token(fast(models.WordPiece(vocab, unk_token="[UNK]"))) is None
    assert max_chars_per_token(fast(models.BPE(vocab, [], unk_token="[UNK]", fuse_unk=True))) is None
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert max_chars_per_token(fast(models.BPE(vocab, []), None, byte_level)) == 5
    assert max_chars_per_token(fast(models.BPE(vocab, []), normalizers.NFC(), byte_level)) == 15
    assert max_chars_per_token(fast(models.BPE(vocab, []), normalizers.StripAccents(), byte_level)) is None


# -- finite numbers -------------------------------------------------------------------------


def _finite_everywhere(text: str) -> None:
    for line in text.splitlines() or [text]:
        line = line.removeprefix("data: ")
        if line and line != "[DONE]":
            strict_json(line)


def test_tiny_temperatures_are_greedy_with_finite_logprobs(server):
    url, _ = server
    greedy = httpx.post(f"{url}/generate", json={"inputs": "hello", "parameters": {
        "max_new_tokens": 8, "details": True, "top_n_tokens": 3}}).json()
    for temperature in (1e-300, 5e-324, 9e-6):
        r = httpx.post(f"{url}/generate", json={"inputs": "hello", "parameters": {
            "temperature": temperature, "max_new_tokens": 8, "details": True, "top_n_tokens": 3}})
        _finite_everywhere(r.text)
        assert r.status_code == 200 and r.json()["generated_text"] == greedy["generated_text"]
        assert [t["id"] for t in r.json()["details"]["tokens"]] == [t["id"] for t in greedy["details"]["tokens"]]
    plain = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 8,
                                                        "temperature": 0}).json()["choices"][0]["text"]
    for stream in (False, True):
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 1e-300,
            "logprobs": True, "top_logprobs": 5, "stream": stream})
        assert r.status_code == 200
        _finite_everywhere(r.text)
        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 8,
                                                       "temperature": 1e-300, "logprobs": 5, "stream": stream})
        _finite_everywhere(r.text)
        if not stream:
            assert r.json()["choices"][0]["text"] == plain


def test_extreme_penalties_give_finite_logprobs(server):
    url, _ = server
    for parameters in ({"repetition_penalty": 1e-300}, {"repetition_penalty": 1e300, "do_sample": True, "seed": 3},
                       {"typical_p": 1e-300, "seed": 1}):
        r = httpx.post(f"{url}/generate", json={"inputs": "hello hello", "parameters": {
            **parameters, "max_new_tokens": 6, "details": True, "top_n_tokens": 5}})
        assert r.status_code == 200, (parameters, r.text)
        _finite_everywhere(r.text)


def test_repair_non_finite_leaves_a_distribution_in_every_row():
    from ember.worker.sampler import repair_non_finite

    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([
        [1.0, 2.0, -inf, 0.5],      # fine: untouched
        [inf, 1.0, inf, -inf],      # +inf: those tokens, equally likely
        [nan, 3.0, 1.0, -inf],      # NaN: banned
        [nan, nan, -inf, -inf],     # nothing left: uniform
        [-inf, -inf, -inf, -inf],   # all banned: uniform
    ])
    out = repair_non_finite(logits.clone())
    assert torch.equal(out[0], logits[0])
    probs = out.softmax(-1)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(5))
    assert probs[1].tolist() == [0.5, 0.0, 0.5, 0.0]
    assert probs[2, 0] == 0 and probs[2, 1] > probs[2, 2]
    assert probs[3].tolist() == [0.25] * 4


def test_a_processor_that_makes_infinities_yields_finite_output(tiny_llama_dir):
    """A (third party's) processor that overflows: the sampler still draws finite logprobs."""
    from ember import LLM, SamplingParams
    from ember.plugin import hookimpl
    from ember.plugin.logits_processor import BaseLogitsProcessor

    class Overflow(BaseLogitsProcessor):
        name = "overflow"

        def apply(self, logits, rows):
            logits[:, 5] = float("inf")
            logits[:, 6] = float("nan")
            return logits

    class Plugin:
        @hookimpl
        def ember_register_logits_processors(self, registry):
            registry.register("overflow", Overflow)

    from ember.plugin import create_plugin_manager

    pm = create_plugin_manager(extra_plugins=[("overflow-test", Plugin())])
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=32, block_size=8, plugin_manager=pm)
    for params in (SamplingParams(temperature=0, max_tokens=4, logprobs=3, extra={"overflow": {}}),
                   SamplingParams(temperature=0.8, seed=1, max_tokens=4, logprobs=3, extra={"overflow": {}})):
        completion = llm.generate("hello", params)[0].outputs[0]
        assert completion.token_ids == [5, 5, 5, 5]
        assert all(math.isfinite(lp) for lp in completion.token_logprobs)
        assert all(math.isfinite(p.logprob) for position in completion.logprobs for p in position.values())


def test_watermark_delta_is_bounded_and_detect_gamma_is_a_422(server):
    from ember.plugins.watermark.green_list import MAX_DELTA, check_delta

    assert check_delta(MAX_DELTA) == MAX_DELTA
    for bad in (1e308, float("inf"), float("nan"), -1.0, MAX_DELTA * 1.01):
        with pytest.raises(ValueError, match=r"delta must be a number in \[0, 1000\]"):
            check_delta(bad)
    url, _ = server
    r = httpx.post(f"{url}/generate", json={"inputs": "x", "parameters": {
        "watermark": True, "extra": {"watermark": {"delta": 1e308}}}})
    assert r.status_code == 422 and "1e+308" in r.json()["error"]
    for gamma in (1e-300, 1e-9):
        r = httpx.post(f"{url}/watermark/detect", json={"text": "hello there", "gamma": gamma})
        assert r.status_code == 422 and "leaves no green token" in r.json()["error"], r.text


# -- documents and messages -------------------------------------------------------------------


def test_openapi_lists_plugin_routes_and_metrics(server):
    url, _ = server
    spec = httpx.get(f"{url}/openapi.json").json()
    detect = spec["paths"]["/watermark/detect"]["post"]
    assert detect["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/DetectRequest")
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "408" in spec["paths"]["/generate"]["post"]["responses"]


def test_error_messages_show_the_value_not_a_placeholder(server):
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "logit_bias": {"abc": 1}})
    message = r.json()["error"]["message"]
    assert r.status_code == 422 and "got 'abc'" in message and "{" not in message.split("(got")[0]
