"""API key, CORS and request ids on a real server (tiny random Llama): right, wrong,
missing and malformed keys on every protected route, in each route's error shape;
open routes stay open; ids honoured, generated, echoed, refused when unsafe."""

from __future__ import annotations

import logging
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import running_server, wait_idle

from ember.api.cli import main
from ember.api.settings import ServerSettings

KEY = "s3cret-Key_0123456789"
ORIGIN = "https://app.example"
GENERATE = ("POST", "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})
CHAT = ("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
PROTECTED = [
    GENERATE,
    ("POST", "/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/tokenize", {"inputs": "hi"}),
    ("POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}),
    CHAT,
    ("GET", "/v1/models", None),
    ("POST", "/watermark/detect", {"text": "hello there"}),  # a plugin's route
]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=64, api_key=KEY, cors_allow_origins=(ORIGIN,)) as running:
        yield running


def call(url, method, path, body, headers=None):
    return httpx.request(method, url + path, json=body, headers=headers or {}, timeout=60)


def bearer(key=KEY):
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("method, path, body", PROTECTED)
def test_protected_routes_need_the_key(server, method, path, body):
    url, _ = server
    missing = call(url, method, path, body)
    assert missing.status_code == 401, missing.text
    wrong = call(url, method, path, body, bearer("s3cret-Key_012345678X"))
    assert wrong.status_code == 401
    right = call(url, method, path, body, bearer())
    assert right.status_code == 200, right.text
    if path.startswith("/v1/"):  # OpenAI's error shape
        assert missing.json()["error"]["type"] == "invalid_request_error" and missing.json()["error"]["code"] == "unauthorized"
        assert "missing API key" in missing.json()["error"]["message"]
        assert wrong.json()["error"]["message"] == "invalid API key"
    else:  # TGI's
        assert missing.json()["error_type"] == "unauthorized" and "missing API key" in missing.json()["error"]
        assert wrong.json() == {"error": "invalid API key", "error_type": "unauthorized"}


@pytest.mark.parametrize(
    "authorization",
    ["Basic czNjcmV0", "Bearer", "", KEY, f"Bearer {KEY} extra", f"Token {KEY}", f"Bearer{KEY}"],
)
def test_malformed_authorization_headers(server, authorization):
    url, _ = server
    r = call(url, *GENERATE, {"Authorization": authorization})
    assert r.status_code == 401
    assert r.json() == {"error": "malformed Authorization header: expected `Authorization: Bearer <key>`",
                        "error_type": "unauthorized"}
    assert KEY not in r.text


def test_scheme_is_case_insensitive_and_the_key_is_not(server):
    url, _ = server
    assert call(url, *GENERATE, {"Authorization": f"bearer {KEY}"}).status_code == 200
    assert call(url, *GENERATE, bearer(KEY.lower())).status_code == 401
    assert call(url, *GENERATE, bearer(KEY + "x")).status_code == 401
    assert call(url, *GENERATE, bearer(KEY[:-1])).status_code == 401
    # not ASCII: refused like any wrong key, not a server error
    assert call(url, *GENERATE, {"Authorization": "Bearer clé".encode("utf-8")}).status_code == 401


def test_open_routes_need_no_key(server):
    url, _ = server
    for path in ("/health", "/metrics", "/info", "/openapi.json", "/docs"):
        assert httpx.get(url + path).status_code == 200, path


def test_refusals_are_counted_as_unauthorized(server):
    url, app = server
    call(url, *CHAT)
    wait_idle(app)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    samples = [s for s in families["ember_requests"].samples if s.name == "ember_requests_total"
               and s.labels == {"route": "/v1/chat/completions", "outcome": "client_error", "error_type": "unauthorized"}]
    assert samples and samples[0].value >= 1


def test_cors(server):
    url, _ = server
    preflight = httpx.options(f"{url}/generate", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200  # no key needed for a preflight
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    other = httpx.options(f"{url}/generate", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    r = call(url, *GENERATE, {**bearer(), "Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in r.headers["access-control-expose-headers"]


def test_request_ids(server):
    url, _ = server
    given = call(url, *GENERATE, {**bearer(), "x-request-id": "client-id-42"})
    assert given.headers["x-request-id"] == "client-id-42"
    a = call(url, *GENERATE, bearer()).headers["x-request-id"]
    b = call(url, *GENERATE, bearer()).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", a) and a != b
    # refusals carry an id too, and the same id can be reused by a client
    assert call(url, *GENERATE, {"x-request-id": "client-id-42"}).headers["x-request-id"] == "client-id-42"
    assert call(url, *GENERATE, {**bearer(), "x-request-id": "client-id-42"}).status_code == 200
    for bad in ("has space", "x" * 129, ""):
        r = call(url, *GENERATE, {**bearer(), "x-request-id": bad})
        assert r.status_code == 400, bad
        assert r.json()["error_type"] == "bad_request" and "x-request-id" in r.json()["error"]
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])


def test_without_a_key_everything_is_open(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=64) as (url, _):
        assert call(url, *GENERATE).status_code == 200
        assert call(url, *GENERATE, bearer("anything")).status_code == 200


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"api_key": "two words"}, "--api-key must be 1 to 512 visible ASCII characters"),
        ({"api_key": ""}, "--api-key must be 1 to 512"),
        ({"cors_allow_origins": ("app.example",)}, "--cors-allow-origin 'app.example' is not an origin"),
        ({"cors_allow_origins": ("https://app.example/path",)}, "is not an origin"),
        ({"otlp_endpoint": "localhost:4318"}, "--otlp-endpoint 'localhost:4318' must be an http(s) URL"),
        ({"graceful_termination_timeout": -1.0}, "--graceful-termination-timeout must be a number of seconds >= 0"),
        ({"graceful_termination_timeout": float("nan")}, "--graceful-termination-timeout must be"),
    ],
)
def test_bad_production_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerSettings(**settings)


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("EMBER_GRACEFUL_TERMINATION_TIMEOUT", "-5", "--graceful-termination-timeout must be a number of seconds >= 0"),
        ("EMBER_GRACEFUL_TERMINATION_TIMEOUT", "soon", "EMBER_GRACEFUL_TERMINATION_TIMEOUT='soon' is invalid"),
        ("EMBER_API_KEY", "a b", "--api-key must be"),
        ("EMBER_CORS_ALLOW_ORIGIN", "https://ok.example,nope", "--cors-allow-origin 'nope' is not an origin"),
        ("EMBER_OTLP_ENDPOINT", "collector:4318", "--otlp-endpoint 'collector:4318'"),
        ("EMBER_JSON_OUTPUT", "maybe", "EMBER_JSON_OUTPUT='maybe' is invalid"),
    ],
)
def test_serve_flags_read_their_environment_variables(monkeypatch, capsys, variable, value, message):
    monkeypatch.setenv(variable, value)
    assert main(["serve", "--model-id", "/nonexistent"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "command, argv, environ, names",
    [
        (["serve"], ["--api-key", ""], {}, ("--api-key", "EMBER_API_KEY")),
        (["serve"], [], {"EMBER_API_KEY": ""}, ("--api-key", "EMBER_API_KEY")),
        (["serve"], ["--watermark-key", ""], {}, ("--watermark-key", "EMBER_WATERMARK_KEY")),
        (["serve"], [], {"EMBER_WATERMARK_KEY": ""}, ("--watermark-key", "EMBER_WATERMARK_KEY")),
        (["watermark", "detect", "--text", "hi"], [], {"EMBER_WATERMARK_KEY": ""}, ("--watermark-key", "EMBER_WATERMARK_KEY")),
    ],
)
def test_an_empty_secret_is_refused_before_loading(monkeypatch, capsys, command, argv, environ, names):
    """A secret that failed to render (``EMBER_API_KEY=``) must not turn authentication
    off, nor fall back to the watermark's public default key."""
    import ember.api.server
    import ember.weights

    def fail(*args, **kwargs):
        pytest.fail("a model was loaded")

    monkeypatch.setattr(ember.api.server, "build_engine", fail)
    monkeypatch.setattr(ember.weights, "resolve_model", fail)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert main([*command, "--model-id", "/nonexistent", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ember: error: ") and "is empty" in err, err
    assert all(name in err for name in names), err


def test_the_startup_log_says_whether_api_key_auth_is_on(tiny_llama_dir, monkeypatch, caplog):
    import ember.api.server as server
    from ember.config import EngineConfig
    from ember.engine.async_engine import AsyncLLMEngine
    from ember.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64))

    class NotRun:
        engine_died = False

        def run(self) -> None:
            pass

    monkeypatch.setattr(server, "build_engine", lambda settings: AsyncLLMEngine(engine))
    monkeypatch.setattr(server, "create_server", lambda app, settings: NotRun())
    with caplog.at_level(logging.INFO, logger="ember.api.server"):
        server.serve(ServerSettings(model_id=str(tiny_llama_dir)))
        server.serve(ServerSettings(model_id=str(tiny_llama_dir), api_key=KEY))
    lines = [r.getMessage() for r in caplog.records if r.name == "ember.api.server" and "serving" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "API-key auth off: every route is open" in lines[0]
    assert "API-key auth on" in lines[1] and KEY not in lines[1]
