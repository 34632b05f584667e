"""A hostile client against a real `ember serve` (tiny random Llama, a subprocess).

One bounded loop on 127.0.0.1 sends a table of malformed, oversized and adversarial
requests over every route while a probe hits /health every 100 ms. For every row:
no 5xx; every response Ember writes is strict JSON (no NaN, no Infinity; SSE events
each strict JSON) with a JSON error body on 4xx; and a normal request is served right
after it. Over the whole loop /health is never slower than 1 s and never fails.

Some rows are raw sockets (a stalled upload, a client that hangs up mid-body);
others time out or expect a particular status. Protocol-level garbage (a request line
that is not HTTP) is answered by uvicorn itself before Ember sees it, in plain text:
that row checks only that the server lives on.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest
from test_shutdown import Serve

BODY_TIMEOUT_S = 1.5
MAX_TOTAL = 256
BIG = "x" * 1_900_000  # a 1.9 MB prompt: far past what 255 input tokens can hold
HEALTH_LIMIT_S = 1.0


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity (Python's default accepts them)."""

    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")

    value = json.loads(text, parse_constant=refuse)
    _check_finite(value)
    return value


def _check_finite(value) -> None:
    if isinstance(value, float):
        assert math.isfinite(value), value
    elif isinstance(value, dict):
        for item in value.values():
            _check_finite(item)
    elif isinstance(value, list):
        for item in value:
            _check_finite(item)


@dataclass
class Outcome:
    status: int | None  # None: no response (the client hung up first)
    content_type: str = ""
    body: bytes = b""


@dataclass
class Row:
    name: str
    send: Callable[[Serve], Outcome]
    expect: int | tuple[int, ...] | None = None  # None: any status below 500
    checks: list[Callable[[Outcome], None]] = field(default_factory=list)


# -- senders ----------------------------------------------------------------------------


def http(method: str, path: str, body: bytes | None = None, headers: dict | None = None, timeout: float = 60):
    def send(server: Serve) -> Outcome:
        hdrs = {"content-type": "application/json"} if body is not None else {}
        hdrs.update(headers or {})
        hdrs = {k: v for k, v in hdrs.items() if v is not None}  # None: leave the header out
        r = httpx.request(method, f"{server.url}{path}", content=body, headers=hdrs, timeout=timeout)
        return Outcome(r.status_code, r.headers.get("content-type", ""), r.content)

    return send


def post(path: str, payload, **kw):
    return http("POST", path, json.dumps(payload).encode(), **kw)


def raw(path: str, body: bytes) -> Callable[[Serve], Outcome]:
    return http("POST", path, body)


def socket_exchange(data: bytes, *, then: bytes = b"", pause_s: float = 0.0, hang_up: bool = False,
                    drip: bytes = b"", drip_every_s: float = 0.5) -> Callable[[Serve], Outcome]:
    """Send ``data``; optionally pause and send ``then``; drip ``drip`` a byte at a
    time; or hang up. Returns the parsed response, if one came."""

    def send(server: Serve) -> Outcome:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(data)
            if pause_s:
                time.sleep(pause_s)
            if then:
                sock.sendall(then)
            if hang_up:
                sock.shutdown(socket.SHUT_RDWR)
                return Outcome(None)
            sock.settimeout(0.05 if drip else 30)
            response = b""
            for byte in drip:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    break  # the server answered and closed
                try:
                    chunk = sock.recv(65536)
                    if chunk:
                        response += chunk
                        break
                except TimeoutError:
                    pass
                time.sleep(drip_every_s)
            sock.settimeout(30)
            while True:
                try:
                    chunk = sock.recv(65536)
                except (ConnectionResetError, TimeoutError):
                    break
                if not chunk:
                    break
                response += chunk
        return parse_response(response)

    return send


def parse_response(response: bytes) -> Outcome:
    if not response:
        return Outcome(None)  # closed without a word
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if "content-length" in headers:
        body = body[: int(headers["content-length"])]
    return Outcome(status, headers.get("content-type", ""), body)


def request_head(path: str, content_length: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {content_length}\r\n{extra}\r\n").encode()


# -- checks -----------------------------------------------------------------------------


def error_names(*words: str) -> Callable[[Outcome], None]:
    def check(out: Outcome) -> None:
        text = json.dumps(strict_json(out.body.decode()))
        for word in words:
            assert word in text, (word, text)

    return check


def num_tokens(expected: int) -> Callable[[Outcome], None]:
    def check(out: Outcome) -> None:
        assert len(strict_json(out.body.decode())) == expected

    return check


def finite_logprobs(out: Outcome) -> None:
    """Every logprob a 200 carries is a finite number (also checked by strict_json)."""
    assert out.status == 200, out.body[:300]
    assert b"NaN" not in out.body and b"Infinity" not in out.body


J = {"inputs": "hello"}
DEEP = b"[" * 100_000 + b"]" * 100_000
DIGITS = "9" * 5000


def ROWS() -> list[Row]:
    digits_seed = f'{{"inputs": "x", "parameters": {{"seed": {DIGITS}}}}}'.encode()
    chat = lambda **kw: {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}
    completion = lambda **kw: {"model": "m", "prompt": "hi", "max_tokens": 4, **kw}
    tiny_t = {"inputs": "hello", "parameters": {"temperature": 1e-300, "max_new_tokens": 6, "details": True,
                                               "top_n_tokens": 3, "decoder_input_details": True}}
    return [
        # -- JSON that Python accepts and strict JSON does not ---------------------------
        Row("5000-digit integer (TGI seed)", raw("/generate", digits_seed), 400, [error_names("5000 digits")]),
        Row("5000-digit integer (OpenAI max_tokens)",
            raw("/v1/completions", f'{{"model": "m", "prompt": "x", "max_tokens": {DIGITS}}}'.encode()), 400),
        Row("100k-deep nested array", raw("/generate", DEEP), 400, [error_names("nested")]),
        Row("100k-deep nesting inside extra",
            raw("/generate", b'{"inputs": "x", "parameters": {"extra": ' + DEEP + b"}}"), 400),
        Row("65-deep nesting inside extra",
            raw("/v1/chat/completions", b'{"model": "m", "messages": [], "extra": ' + b"[" * 65 + b"]" * 65 + b"}"), 400),
        Row("NaN literal", raw("/generate", b'{"inputs": "x", "parameters": {"temperature": NaN}}'), 400,
            [error_names("NaN")]),
        Row("Infinity literal", raw("/v1/completions", b'{"model": "m", "prompt": "x", "temperature": Infinity}'), 400),
        Row("-Infinity logit bias", raw("/v1/completions", b'{"model": "m", "prompt": "x", "logit_bias": {"5": -Infinity}}'), 400),
        Row("1e400 overflows to infinity", raw("/generate", b'{"inputs": "x", "parameters": {"temperature": 1e400}}'), 400),
        Row("lone UTF-16 surrogate", raw("/generate", b'{"inputs": "a\\ud800b"}'), 400, [error_names("surrogate")]),
        Row("lone surrogate in chat", raw("/v1/chat/completions",
            b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}'), 400),
        Row("surrogate pair is fine", raw("/generate", b'{"inputs": "a\\ud83d\\ude00b", "parameters": {"max_new_tokens": 2}}'), 200),
        Row("not UTF-8", raw("/generate", b'{"inputs": "\xff\xfe"}'), 400),
        Row("UTF-8 BOM", raw("/generate", b'\xef\xbb\xbf{"inputs": "x"}'), 400),
        Row("empty body", raw("/v1/chat/completions", b""), 400),
        Row("body is null", raw("/generate", b"null"), 422),
        Row("body is a string", raw("/tokenize", b'"hello"'), 422),
        Row("body is an array", raw("/v1/completions", b"[1, 2]"), 422),
        Row("truncated JSON", raw("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "us'), 400),
        # -- numbers at the edges -------------------------------------------------------
        Row("temperature 1e-300 (TGI, details, top tokens)", post("/generate", tiny_t), 200, [finite_logprobs]),
        Row("temperature 1e-300 (TGI stream)", post("/generate_stream", {**tiny_t, "parameters": {
            **tiny_t["parameters"], "decoder_input_details": False}}), 200, [finite_logprobs]),
        Row("temperature 1e-300 (completions, logprobs)",
            post("/v1/completions", completion(temperature=1e-300, logprobs=5)), 200, [finite_logprobs]),
        Row("temperature 1e-300 (chat stream, top_logprobs)",
            post("/v1/chat/completions", chat(temperature=1e-300, logprobs=True, top_logprobs=5, stream=True)), 200,
            [finite_logprobs]),
        Row("repetition_penalty 1e-300", post("/generate", {"inputs": "hello hello", "parameters": {
            "repetition_penalty": 1e-300, "max_new_tokens": 6, "details": True, "top_n_tokens": 5}}), 200,
            [finite_logprobs]),
        Row("repetition_penalty 1e300 (sampled)", post("/v1/completions", completion(
            repetition_penalty=1e300, temperature=0.7, seed=1, logprobs=5)), 200, [finite_logprobs]),
        Row("temperature 2, top_p 1e-300", post("/v1/completions", completion(temperature=2.0, top_p=1e-300, logprobs=3)),
            200, [finite_logprobs]),
        Row("typical_p 1e-300", post("/generate", {"inputs": "x", "parameters": {
            "do_sample": True, "typical_p": 1e-300, "max_new_tokens": 4, "details": True}}), 200, [finite_logprobs]),
        Row("watermark delta 1e308", post("/generate", {"inputs": "x", "parameters": {
            "watermark": True, "extra": {"watermark": {"delta": 1e308}}}}), 422, [error_names("delta", "1e+308")]),
        Row("watermark delta 1e308 (stream)", post("/v1/chat/completions", chat(
            stream=True, watermark=True, extra={"watermark": {"delta": 1e308}})), 422),
        Row("watermark delta 1000 (bound)", post("/generate", {"inputs": "x", "parameters": {
            "watermark": True, "max_new_tokens": 4, "details": True, "extra": {"watermark": {"delta": 1000}}}}), 200,
            [finite_logprobs]),
        Row("detect gamma 1e-300", post("/watermark/detect", {"text": "hello there", "gamma": 1e-300}), 422,
            [error_names("gamma")]),
        Row("detect gamma 1 - 1e-16", post("/watermark/detect", {"token_ids": [5, 6, 7, 8], "gamma": 1 - 1e-16}), 200),
        Row("detect token id 2**63", post("/watermark/detect", {"token_ids": [1, 2**63]}), 422),
        Row("detect 100k token ids", post("/watermark/detect", {"token_ids": [1] * 100_000}), 422),
        Row("detect 1.9 MB text", post("/watermark/detect", {"text": BIG}), 422),
        Row("logit_bias key not a token id", post("/v1/completions", completion(logit_bias={"abc": 1})), 422,
            [error_names("'abc'")]),
        Row("logit_bias key past the vocabulary", post("/v1/completions", completion(logit_bias={"9" * 30: 1})), 422),
        Row("seed 2**64", post("/v1/completions", completion(seed=2**64)), 422),
        Row("max_tokens 10**30", post("/v1/completions", completion(max_tokens=10**30)), 422),
        Row("top_k 10**30", post("/v1/completions", completion(top_k=10**30, temperature=1.0)), 200),
        Row("priority 2**40", post("/generate", {"inputs": "x", "parameters": {"priority": 2**40}}), 422),
        Row("n 17", post("/v1/completions", completion(n=17)), 422),
        Row("best_of 1000", post("/generate", {"inputs": "x", "parameters": {"best_of": 1000, "do_sample": True}}), 422),
        Row("logprobs 100", post("/v1/completions", completion(logprobs=100)), 422),
        Row("top_logprobs 21", post("/v1/chat/completions", chat(logprobs=True, top_logprobs=21)), 422),
        Row("prompt token ids negative", post("/v1/completions", completion(prompt=[-1, 5])), 422),
        Row("prompt token id 2**70", post("/v1/completions", completion(prompt=[2**70])), 422),
        Row("prompt list of empty lists", post("/v1/completions", completion(prompt=[[], []])), 422),
        Row("1000 stop strings", post("/v1/completions", completion(stop=["a"] * 1000)), 422),
        Row("one 500 kB stop string", post("/v1/completions", completion(stop="z" * 500_000)), 200),
        Row("64 bad words of 20 kB", post("/v1/completions", completion(bad_words=["w" * 20_000] * 64)), None),
        Row("model name of 1 MB", post("/v1/chat/completions", {**chat(), "model": "m" * 1_000_000}), 422),
        # -- size: bodies and prompts ------------------------------------------------------
        Row("1.9 MB prompt (TGI)", post("/generate", {"inputs": BIG}), 422, [error_names("characters")]),
        Row("1.9 MB prompt, truncate 8", post("/generate", {"inputs": BIG, "parameters": {
            "truncate": 8, "max_new_tokens": 2}}), 200),
        Row("1.9 MB /tokenize", post("/tokenize", {"inputs": BIG}), 422),
        Row("/tokenize past the input limit", post("/tokenize", {"inputs": "y" * 300}), 422),
        Row("1.9 MB /tokenize, truncate 5", post("/tokenize", {"inputs": BIG, "parameters": {"truncate": 5}}), 200,
            [num_tokens(5)]),
        Row("1.9 MB chat message", post("/v1/chat/completions", {**chat(), "messages": [{"role": "user", "content": BIG}]}), 422),
        Row("1.9 MB in 100 prompts", post("/v1/completions", completion(prompt=["p" * 19_000] * 100)), 422),
        Row("10k chat messages", post("/v1/chat/completions", {**chat(), "messages": [{"role": "user", "content": "a"}] * 10_000}), 422),
        Row("body past --payload-limit (declared)", socket_exchange(request_head("/generate", 3_000_000)), 413),
        Row("chunked body past the limit", lambda s: _chunked(s, 2_100_000), 413),
        # -- slow and vanishing clients ----------------------------------------------------
        Row("headers, then no body (slowloris)", socket_exchange(request_head("/generate", 100)), 408,
            [error_names("--request-body-timeout")]),
        Row("half a body, then silence", socket_exchange(request_head("/v1/completions", 200) + b'{"model": "m", '), 408),
        Row("a body dripped a byte per 0.5 s", socket_exchange(request_head("/generate", 40), drip=b'{"inputs": "hello hello hello h"}'), 408),
        Row("hang up mid-body", socket_exchange(request_head("/generate", 1000) + b'{"inputs": "x', hang_up=True), None),
        Row("hang up right after the headers", socket_exchange(request_head("/v1/chat/completions", 50), hang_up=True), None),
        Row("garbage request line", socket_exchange(b"\x16\x03\x01\x02\x00GARBAGE\r\n\r\n"), None),
        # -- headers, routes, methods --------------------------------------------------------
        Row("text/plain content type", http("POST", "/generate", b'{"inputs": "x"}', {"content-type": "text/plain"}), 415),
        Row("no content type", http("POST", "/generate", b'{"inputs": "x", "parameters": {"max_new_tokens": 2}}',
                                    {"content-type": None}), 200),
        Row("bad x-request-id", http("POST", "/generate", b'{"inputs": "x"}', {"x-request-id": "a b"}), 400),
        Row("unknown route", http("POST", "/v2/nothing", b"{}"), 404),
        Row("wrong method", http("GET", "/generate"), 405),
        Row("DELETE on chat", http("DELETE", "/v1/chat/completions"), 405),
        Row("GET /v1/models with a body", http("GET", "/v1/models", b"garbage"), 200),
        Row("unknown field", post("/v1/completions", completion(bogus=1)), 422, [error_names("bogus")]),
        Row("suffix not available", post("/v1/completions", completion(suffix="x")), 422),
        Row("tool without a function", post("/v1/chat/completions", chat(tools=[{"type": "function"}])), 400),
        Row("response_format json_schema without a schema", post("/v1/chat/completions",
                                                                 chat(response_format={"type": "json_schema"})), 400),
        Row("stream_options without stream", post("/v1/completions", completion(stream_options={"include_usage": True})), 422),
        Row("image content part to a text-only model", post("/v1/chat/completions", {**chat(), "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}), 400,
            [error_names("takes no images")]),
        Row("role tool (a tool result)", post("/v1/chat/completions", {**chat(), "messages": [{"role": "tool", "content": "x"}]}), 200),
        Row("echo with token ids and logprobs", post("/v1/completions", completion(prompt=[5, 6, 7], echo=True, logprobs=2)),
            200, [finite_logprobs]),
        # -- /v1/messages and /v1/messages/count_tokens (Anthropic's shape) --------------
        *ANTHROPIC_ROWS(),
        *RESPONSES_ROWS(),
        *POOLING_ROWS(),
        Row("/info, /metrics, /openapi.json", lambda s: _open_routes(s), 200),
    ]


def ANTHROPIC_ROWS() -> list[Row]:
    msg = lambda **kw: {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **kw}
    user = lambda *blocks: msg(messages=[{"role": "user", "content": list(blocks)}])
    named = lambda *words: [anthropic_error, error_names(*words)]
    return [
        Row("messages: 1.9 MB message", post("/v1/messages", msg(messages=[{"role": "user", "content": BIG}])), 422,
            [anthropic_error]),
        Row("messages: 10k messages", post("/v1/messages", msg(messages=[{"role": "user", "content": "a"}] * 10_000)),
            422, [anthropic_error]),
        Row("messages: 1.9 MB text block", post("/v1/messages", user({"type": "text", "text": BIG})), 422),
        Row("messages: 100k-deep nesting", raw("/v1/messages", DEEP), 400, [anthropic_error]),
        Row("messages: empty body", raw("/v1/messages", b""), 400, [anthropic_error]),
        Row("messages: no max_tokens", post("/v1/messages", {"model": "m", "messages": [
            {"role": "user", "content": "hi"}]}), 400, named("max_tokens")),
        Row("messages: image block", post("/v1/messages", user({"type": "image", "source": {}})), 400, named("image")),
        Row("messages: block that is a string", post("/v1/messages", user("text")), 400, named("messages.0.content", "content block")),
        Row("messages: tool_use from the user", post("/v1/messages", user(
            {"type": "tool_use", "id": "a", "name": "b", "input": {}})), 400, named("tool_use")),
        Row("messages: tool_use input a list", post("/v1/messages", msg(messages=[{"role": "assistant", "content": [
            {"type": "tool_use", "id": "a", "name": "b", "input": []}]}])), 400, named("input")),
        Row("messages: tool_result of 1.9 MB", post("/v1/messages", user(
            {"type": "tool_result", "tool_use_id": "a", "content": BIG})), 422),
        Row("messages: thinking", post("/v1/messages", msg(thinking={"type": "enabled", "budget_tokens": 9})), 400,
            named("thinking")),
        Row("messages: tool_choice without name", post("/v1/messages", msg(
            tools=[{"name": "t", "input_schema": {"type": "object"}}], tool_choice={"type": "tool"})), 400,
            named("tool_choice.name")),
        Row("messages: temperature 1e-300 (stream)", post("/v1/messages", msg(temperature=1e-300, stream=True)), 200),
        Row("count_tokens: 1.9 MB system", post("/v1/messages/count_tokens", {
            "model": "m", "system": BIG, "messages": [{"role": "user", "content": "hi"}]}), 422, [anthropic_error]),
        Row("count_tokens: unknown field", post("/v1/messages/count_tokens", {
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "bogus": 1}), 400, named("bogus")),
        Row("GET /v1/messages", http("GET", "/v1/messages"), 405, [anthropic_error]),
    ]


def RESPONSES_ROWS() -> list[Row]:
    """/v1/responses (OpenAI's Responses API) and its stored-response routes."""
    rsp = lambda **kw: {"model": "m", "input": "hi", "max_output_tokens": 4, **kw}
    item = lambda *items: rsp(input=list(items))
    named = lambda *words: [openai_error, error_names(*words)]
    return [
        Row("responses: 1.9 MB input", post("/v1/responses", rsp(input=BIG)), 422, [openai_error]),
        Row("responses: 10k items", post("/v1/responses", item(*[{"role": "user", "content": "a"}] * 10_000)), 422),
        Row("responses: 1.9 MB instructions", post("/v1/responses", rsp(instructions=BIG)), 422),
        Row("responses: 1.9 MB function output", post("/v1/responses", item(
            {"type": "function_call_output", "call_id": "c", "output": BIG})), 422),
        Row("responses: 100k-deep nesting", raw("/v1/responses", DEEP), 400, [openai_error]),
        Row("responses: empty body", raw("/v1/responses", b""), 400, [openai_error]),
        Row("responses: no input", post("/v1/responses", {"model": "m"}), 400, named("input")),
        Row("responses: image part", post("/v1/responses", item({"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x"}]})), 400, named("input[0].content[0]", "takes no images")),
        Row("responses: item that is a string", post("/v1/responses", item("text")), 400, named("input")),
        Row("responses: function_call without call_id", post("/v1/responses", item(
            {"type": "function_call", "name": "f", "arguments": "{}"})), 400, named("call_id")),
        Row("responses: function_call arguments a list", post("/v1/responses", item(
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1, 2]"})), 400, named("arguments")),
        Row("responses: web_search tool", post("/v1/responses", rsp(tools=[{"type": "web_search"}])), 400,
            named("tools[0].type")),
        Row("responses: background", post("/v1/responses", rsp(background=True)), 400, named("background")),
        Row("responses: unknown previous_response_id", post("/v1/responses", rsp(previous_response_id="resp_x")),
            404, named("resp_x")),
        Row("responses: temperature 1e-300 (stream)", post("/v1/responses", rsp(temperature=1e-300, stream=True)),
            200),
        Row("responses: 5k-character id", http("GET", "/v1/responses/" + "x" * 5000), 404, [openai_error]),
        Row("responses: cancel unknown", post("/v1/responses/resp_x/cancel", {}), 404, [openai_error]),
        Row("responses: input_items of an unknown id", http("GET", "/v1/responses/resp_x/input_items?limit=" + DIGITS),
            404, [openai_error]),
        Row("GET /v1/responses", http("GET", "/v1/responses"), 405, [openai_error]),
    ]


def POOLING_ROWS() -> list[Row]:
    """/v1/embeddings, /v1/rerank, /rerank and /v1/score (OpenAI's error shape on all four)."""
    emb = lambda **kw: {"model": "m", "input": "hi", **kw}
    named = lambda *words: [openai_error, error_names(*words)]
    return [
        Row("embeddings: 1.9 MB input", post("/v1/embeddings", emb(input=BIG)), 422, named("input")),
        Row("embeddings: 1.9 MB in 100 inputs", post("/v1/embeddings", emb(input=["p" * 19_000] * 100)), 422,
            named("input")),
        Row("embeddings: 10k inputs", post("/v1/embeddings", emb(input=["a"] * 10_000)), 422, named("input")),
        Row("embeddings: 100k-deep nesting", raw("/v1/embeddings", DEEP), 400, [openai_error]),
        Row("embeddings: empty body", raw("/v1/embeddings", b""), 400, [openai_error]),
        Row("embeddings: token id 2**70", post("/v1/embeddings", emb(input=[2**70])), 422, named("input")),
        Row("embeddings: list of empty lists", post("/v1/embeddings", emb(input=[[], []])), 422, named("input[0]")),
        Row("embeddings: dimensions on a model without Matryoshka", post("/v1/embeddings", emb(dimensions=8)), 400,
            named("dimensions")),
        Row("embeddings: base64", post("/v1/embeddings", emb(encoding_format="base64")), 200),
        Row("rerank: 1.9 MB query", post("/v1/rerank", {"query": BIG, "documents": ["a"]}), 422, named("query")),
        Row("rerank: 1.9 MB document", post("/v1/rerank", {"query": "q", "documents": [BIG]}), 422,
            named("documents[0]")),
        Row("rerank: 10k documents", post("/v1/rerank", {"query": "q", "documents": ["a"] * 10_000}), 422,
            named("documents")),
        Row("rerank: document object without text", post("/rerank", {"query": "q", "documents": [{}]}), 422,
            named("documents")),
        Row("/rerank: empty body", raw("/rerank", b""), 400, [openai_error]),
        Row("score: 1.9 MB text_2", post("/v1/score", {"text_1": "a", "text_2": BIG}), 422, named("text_2")),
        Row("score: 2 against 3", post("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}), 422,
            named("text_2")),
        Row("GET /v1/embeddings", http("GET", "/v1/embeddings"), 405, [openai_error]),
        Row("GET /rerank", http("GET", "/rerank"), 405, [openai_error]),
    ]


def openai_error(out: Outcome) -> None:
    payload = strict_json(out.body.decode())
    assert set(payload["error"]) == {"message", "type", "param", "code"}, payload


def anthropic_error(out: Outcome) -> None:
    payload = strict_json(out.body.decode())
    assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}, payload


def _chunked(server: Serve, size: int) -> Outcome:
    def chunks():
        sent = 0
        while sent < size:
            yield b"x" * 65536
            sent += 65536

    r = httpx.post(f"{server.url}/generate", content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    return Outcome(r.status_code, r.headers.get("content-type", ""), r.content)


def _open_routes(server: Serve) -> Outcome:
    for path in ("/info", "/openapi.json", "/v1/models"):
        r = httpx.get(f"{server.url}{path}", timeout=10)
        assert r.status_code == 200
        strict_json(r.text)
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
    return Outcome(200, "application/json", b"{}")


# -- the loop ---------------------------------------------------------------------------


class HealthProbe(threading.Thread):
    """GET /health every 100 ms; records the slowest answer and every failure."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.slowest = 0.0
        self.num_probes = 0
        self.failures: list[str] = []
        self.current_row = ""
        self.slowest_row = ""

    def run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.stop.is_set():
                start = time.perf_counter()
                try:
                    status = client.get(f"{self.url}/health").status_code
                    if status != 200:
                        self.failures.append(f"{self.current_row}: /health {status}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{self.current_row}: /health {exc!r}")
                elapsed = time.perf_counter() - start
                if elapsed > self.slowest:
                    self.slowest = elapsed
                    self.slowest_row = self.current_row
                self.num_probes += 1
                self.stop.wait(max(0.0, 0.1 - elapsed))


def check_outcome(row: Row, out: Outcome) -> None:
    if out.status is None:
        return  # the client hung up: nothing to read
    assert out.status < 500, (out.status, out.body[:500])
    if row.expect is not None:
        expected = row.expect if isinstance(row.expect, tuple) else (row.expect,)
        assert out.status in expected, (out.status, out.body[:500])
    if row.name == "garbage request line":
        return  # uvicorn's own plain-text 400, before Ember sees anything
    if "text/event-stream" in out.content_type:
        for line in out.body.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                strict_json(line[len("data: "):])
    else:
        assert "application/json" in out.content_type, (out.content_type, out.body[:200])
        payload = strict_json(out.body.decode())
        if out.status >= 400:
            assert "error" in payload, payload


@pytest.fixture(scope="module")
def hostile_server(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("hostile") / "serve.log"
    server = Serve(tiny_llama_dir, log, "--request-body-timeout", str(BODY_TIMEOUT_S), "--payload-limit", "2000000",
                   "--max-input-tokens", "255")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_hostile_table_leaves_the_server_healthy(hostile_server):
    server = hostile_server
    rows = ROWS()
    assert len(rows) >= 60
    probe = HealthProbe(server.url)
    probe.start()
    failures = []
    try:
        for row in rows:
            probe.current_row = row.name
            try:
                out = row.send(server)
                check_outcome(row, out)
                for check in row.checks:
                    check(out)
            except Exception as exc:  # collect every failing row, not just the first
                failures.append(f"{row.name}: {exc!r}"[:600])
            assert server.proc.poll() is None, f"the server died at row {row.name!r}:\n{server.log.read_text()[-3000:]}"
            normal = httpx.post(f"{server.url}/generate", json={"inputs": "after", "parameters": {"max_new_tokens": 2}},
                                timeout=30)
            if normal.status_code != 200:
                failures.append(f"{row.name}: the next normal request got {normal.status_code} {normal.text[:200]}")
    finally:
        probe.stop.set()
        probe.join()
    print(f"\nhostile table: {len(rows)} rows, {len(failures)} failing; /health probed {probe.num_probes} times, "
          f"slowest {probe.slowest * 1000:.0f} ms (during {getattr(probe, 'slowest_row', '-')!r})")
    assert not failures, "\n".join(failures)
    assert not probe.failures, probe.failures[:10]
    assert probe.num_probes > 50
    assert probe.slowest < HEALTH_LIMIT_S, f"/health took {probe.slowest:.2f} s during {probe.slowest_row!r}"
    # nothing the table sent was a server error, in the server's own accounts either
    metrics = httpx.get(f"{server.url}/metrics").text
    server_errors = [line for line in metrics.splitlines() if 'outcome="server_error"' in line and not line.endswith(" 0.0")]
    assert not server_errors, server_errors
    assert 'error_type="client_disconnected"' in metrics
    log = server.log.read_text()
    assert "Traceback" not in log and "ClientDisconnect" not in log, log[-3000:]
