"""ember.multimodal.fetch: media URLs fetched under an SSRF-safe policy.

Every remote fetch goes to a loopback HTTP(S) server started here; host names such as `media.test`
reach it only through the test's own resolver (as vLLM's SSRF tests patch resolution), and addresses
that must never be connected to are caught by replacing the module's socket opener.
"""

from __future__ import annotations

import builtins
import dataclasses
import http.client
import io
import os
import pickle
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote

import pytest
from PIL import Image

from ember.multimodal import fetch as fetch_mod
from ember.multimodal.fetch import FetchedMedia, FetchPolicy, MediaFetchError, fetch_url, sniff_media_type


def _make_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 30, 60)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _make_png()
PUBLIC_IP = "93.184.215.14"  # never connected to: tests that resolve to it replace the socket opener

# Names a message must not carry: an exception class from socket/ssl/http.client or the builtins.
_EXCEPTION_NAMES = {
    obj.__name__
    for module in (socket, ssl, http.client, builtins)
    for obj in vars(module).values()
    if isinstance(obj, type) and issubclass(obj, BaseException)
}


def assert_safe_message(message: str) -> None:
    assert message and "\n" not in message
    for bad in ("0x", "Traceback", "Errno", "errno", "object at"):
        assert bad not in message, message
    leaked = [name for name in _EXCEPTION_NAMES if name in message]
    assert not leaked, (message, leaked)


def expect_error(reason: str, fn: Callable[..., object], *args: object, **kwargs: object) -> MediaFetchError:
    with pytest.raises(MediaFetchError) as info:
        fn(*args, **kwargs)
    err = info.value
    assert err.reason == reason, (str(err), err.reason)
    assert err.status == (413 if reason == "too_large" else 400)
    assert isinstance(err, ValueError)
    assert_safe_message(str(err))
    return err


class Resolver:
    """A resolver with a fixed table (or a sequence of answers per call), counting its calls."""

    def __init__(self, table: dict[str, list[str]] | None = None,
                 answers: list[list[str]] | None = None) -> None:
        self.table, self.answers, self.calls = table or {}, answers, []

    def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append((host, port))
        if self.answers is not None:
            return self.answers[min(len(self.calls), len(self.answers)) - 1]
        if host in self.table:
            return list(self.table[host])
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


@pytest.fixture
def no_connect(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace the socket opener: record where a fetch would connect, and refuse."""
    attempts: list[str] = []

    def refuse(ip: object, port: int, timeout: float) -> socket.socket:
        attempts.append(str(ip))
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(fetch_mod, "_open_socket", refuse)
    return attempts


# --- the loopback server --------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for k, v in {"Content-Length": str(len(body)), "Connection": "close", **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: C901 - one route table
        server: _Server = self.server  # type: ignore[assignment]
        server.seen.append({"path": self.path, "host": self.headers.get("Host"), "peer": self.client_address[0]})
        path, _, query = self.path.partition("?")
        args = {k: v[0] for k, v in parse_qs(query).items()}
        try:
            if path == "/png":
                self._send(200, PNG, {"Content-Type": "text/html"})  # the header lies; the bytes decide
            elif path == "/host":
                self._send(200, (self.headers.get("Host") or "").encode())
            elif path == "/redirect":
                self._send(int(args.get("code", "302")), b"", {"Location": args["to"]})
            elif path.startswith("/chain/"):
                n = int(path.rsplit("/", 1)[1])
                self._send(302, b"", {"Location": f"/chain/{n - 1}"}) if n else self._send(200, PNG)
            elif path == "/noloc":
                self._send(302)
            elif path.startswith("/status/"):
                self._send(int(path.rsplit("/", 1)[1]), b"no")
            elif path == "/big-declared":
                self._send(200, b"", {"Content-Length": str(10**9)})
                self.wfile.write(b"x" * 65536)
            elif path == "/big-chunked":
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                for _ in range(32):
                    self.wfile.write(b"10000\r\n" + b"y" * 65536 + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")
            elif path == "/big-close":
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                for _ in range(32):
                    self.wfile.write(b"z" * 65536)
            elif path == "/drip":
                self._send(200, b"", {"Content-Length": "1000"})
                for _ in range(100):  # at most 10 s, whatever the client does
                    self.wfile.write(b"d")
                    self.wfile.flush()
                    time.sleep(0.1)
            elif path == "/garbage":
                self.wfile.write(b"this is not HTTP\r\n\r\n")
            elif path == "/short":
                self._send(200, b"abc", {"Content-Length": "100"})
            else:
                self._send(404, b"not found")
        except OSError:
            pass  # the client hung up mid-body, as the byte-cap and deadline tests make it


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[dict[str, object]] = []

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # failed TLS handshakes and hang-ups are what some tests are about


@contextmanager
def serving(tls: ssl.SSLContext | None = None) -> Iterator[_Server]:
    server = _Server()
    if tls is not None:  # handshake in the handler thread, not in the accept loop
        server.socket = tls.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def server() -> Iterator[_Server]:
    with serving() as s:
        yield s


def _port(server: _Server) -> int:
    return server.server_address[1]


LOCAL = Resolver({"media.test": ["127.0.0.1"], "cdn.media.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})


def media_policy(*domains: str, **kw: object) -> FetchPolicy:
    return FetchPolicy(allowed_domains=domains or ("media.test",), timeout_s=kw.pop("timeout_s", 5.0), **kw)  # type: ignore[arg-type]


# --- rule 2: off by default, allow-list ----------------------------------------------------------


def test_remote_fetching_is_off_by_default(server: _Server) -> None:
    resolver = Resolver({"media.test": ["127.0.0.1"]})
    err = expect_error("disabled", fetch_url, f"http://media.test:{_port(server)}/png", FetchPolicy(), resolver=resolver)
    assert "--allowed-media-domains" in str(err)
    expect_error("disabled", fetch_url, f"https://127.0.0.1:{_port(server)}/png", FetchPolicy(), resolver=resolver)
    expect_error("disabled", fetch_url, "file:///etc/hostname", FetchPolicy())
    assert resolver.calls == [] and server.seen == []


def test_fetches_from_exactly_listed_host(server: _Server, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real_open = fetch_mod._open_socket
    monkeypatch.setattr(fetch_mod, "_open_socket", lambda ip, port, t: opened.append(str(ip)) or real_open(ip, port, t))
    resolver = Resolver({"media.test": ["127.0.0.1"]})
    url = f"http://media.test:{_port(server)}/png"
    got = fetch_url(url, media_policy(), resolver=resolver)
    assert got == FetchedMedia(PNG, "image/png", url)  # image/png from the bytes; the server said text/html
    assert resolver.calls == [("media.test", _port(server))]
    assert opened == ["127.0.0.1"]  # the connection goes to the address the resolver returned
    assert server.seen == [{"path": "/png", "host": f"media.test:{_port(server)}", "peer": "127.0.0.1"}]


def test_wildcard_does_not_unlock_loopback(server: _Server) -> None:
    err = expect_error("blocked_address", fetch_url, f"http://media.test:{_port(server)}/png",
                       media_policy("*.test"), resolver=LOCAL)
    assert "loopback" in str(err) and "media.test" in str(err)
    assert server.seen == []


def test_exact_ip_literal_is_allowed_without_resolving(server: _Server) -> None:
    resolver = Resolver()
    url = f"http://127.0.0.1:{_port(server)}/png"
    assert fetch_url(url, media_policy("127.0.0.1"), resolver=resolver).data == PNG
    assert resolver.calls == []
    expect_error("not_allowed", fetch_url, url, media_policy("media.test", "*.test"), resolver=resolver)


@pytest.mark.parametrize("allowed, url, passes", [
    (("example.com",), "http://example.com/a.png", True),
    (("example.com",), "http://EXAMPLE.com./a.png", True),
    (("Example.COM.",), "http://example.com/a.png", True),
    (("example.com",), "http://www.example.com/a.png", False),
    (("*.example.com",), "http://img.example.com/a.png", True),
    (("*.example.com",), "https://a.b.example.com/a.png", True),
    (("*.example.com",), "http://example.com/a.png", False),
    (("*.example.com",), "http://evilexample.com/a.png", False),
    (("*.example.com",), "http://img.example.com.evil.test/a.png", False),
    (("*.example.com",), f"http://{PUBLIC_IP}/a.png", False),
    ((PUBLIC_IP,), f"http://{PUBLIC_IP}:8080/a.png", True),
    (("2606:4700::1111",), "http://[2606:4700:0::1111]/a.png", True),
])
def test_allow_list_matching(allowed: tuple[str, ...], url: str, passes: bool, no_connect: list[str]) -> None:
    resolver = Resolver(answers=[[PUBLIC_IP]])
    if passes:  # past the allow-list, to the (refused) connection
        expect_error("unreachable", fetch_url, url, FetchPolicy(allowed_domains=allowed), resolver=resolver)
        assert no_connect
    else:
        expect_error("not_allowed", fetch_url, url, FetchPolicy(allowed_domains=allowed), resolver=resolver)
        assert resolver.calls == [] and no_connect == []


# --- rule 1: one parse, strict URLs --------------------------------------------------------------


@pytest.mark.parametrize("url", [
    "ftp://media.test/a.png", "gopher://media.test/", "data:image/png;base64,AAAA", "javascript:alert(1)",
    "media.test/a.png", "//media.test/a.png", "",
    "http://user@media.test/a.png", "http://user:pw@media.test/a.png", "http://@media.test/",
    "http:///a.png", "http://:80/a.png", "http://",
    "http://media.test:0/", "http://media.test:65536/", "http://media.test:99999/", "http://media.test:-1/",
    "http://media.test:+80/", "http://media.test:8o/", "http://media.test:80:81/",
    "http://media.test/a b.png", "http://media.test/a\tb", "http://media.test/\nx", " http://media.test/",
    "http://media.test/\x00", "http://media.test/\x7f", "http://media.test/\u3000",
    "http://media.test\\@evil.test/", "http://evil.test\\media.test/", "http://media.test\\.evil.test/",
    "http://[::1/", "http://[media.test]/", "http://med%69a.test/", "http://média.test/",
    "http://[fe80::1%25eth0]/", "http://media.test/" + "a" * 9000,
])
def test_malformed_or_unsupported_urls_are_refused(url: str, no_connect: list[str]) -> None:
    resolver = Resolver({"media.test": [PUBLIC_IP]})
    expect_error("bad_url", fetch_url, url, media_policy("media.test", "*.test"), resolver=resolver)
    assert resolver.calls == [] and no_connect == []


def test_error_pickles_with_reason_and_status() -> None:
    err = pickle.loads(pickle.dumps(MediaFetchError("http://media.test: media is larger than the 1-byte limit", "too_large")))
    assert (str(err), err.reason, err.status) == ("http://media.test: media is larger than the 1-byte limit", "too_large", 413)


def test_non_string_url_is_refused() -> None:
    expect_error("bad_url", fetch_url, b"http://media.test/", media_policy())  # type: ignore[arg-type]


@pytest.mark.parametrize("suffix", ["#@evil.test/x", "#.evil.test", "?u=@evil.test"])
def test_host_is_the_one_urlsplit_found(server: _Server, suffix: str) -> None:
    """Text after '#' or '?' is never an authority: the checked host is the one connected to."""
    resolver = Resolver({"media.test": ["127.0.0.1"]})
    got = fetch_url(f"http://media.test:{_port(server)}/png{suffix}", media_policy(), resolver=resolver)
    assert got.data == PNG
    assert [h for h, _ in resolver.calls] == ["media.test"]
    assert server.seen[0]["path"] == "/png" + (suffix if suffix.startswith("?") else "")


# --- rules 3 and 4: one resolution per hop, checked addresses -------------------------------------


def test_resolves_once_and_connects_to_the_checked_address(no_connect: list[str]) -> None:
    """DNS rebinding: a second lookup would answer 127.0.0.1; there must not be one."""
    resolver = Resolver(answers=[[PUBLIC_IP], ["127.0.0.1"]])
    expect_error("unreachable", fetch_url, "http://img.example.com/a.png",
                 FetchPolicy(allowed_domains=("*.example.com",)), resolver=resolver)
    assert resolver.calls == [("img.example.com", 80)]
    assert no_connect == [PUBLIC_IP]


def test_resolves_once_per_redirect_hop(server: _Server) -> None:
    resolver = Resolver({"media.test": ["127.0.0.1"]})
    url = f"http://media.test:{_port(server)}/chain/2"
    got = fetch_url(url, media_policy(), resolver=resolver)
    assert got.data == PNG and got.url == f"http://media.test:{_port(server)}/chain/0"
    assert resolver.calls == [("media.test", _port(server))] * 3


def test_every_resolved_address_is_checked(no_connect: list[str]) -> None:
    resolver = Resolver({"img.example.com": [PUBLIC_IP, "10.1.2.3"]})
    err = expect_error("blocked_address", fetch_url, "http://img.example.com/", FetchPolicy(allowed_domains=("*.example.com",)),
                       resolver=resolver)
    assert "private" in str(err)
    assert no_connect == []


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.8.9.10", "::1",  # loopback
    "10.0.0.5", "172.16.0.1", "172.31.255.255", "192.168.1.1", "fc00::1", "fd12:3456::1",  # private
    "169.254.169.254", "fe80::1",  # link-local (cloud metadata)
    "100.64.0.1", "100.127.255.254",  # CGNAT
    "224.0.0.1", "239.255.255.250", "ff02::1",  # multicast
    "0.0.0.0", "::", "0.1.2.3",  # unspecified / "this network"
    "240.0.0.1", "255.255.255.255", "198.18.0.1", "192.0.0.8", "192.0.2.1", "2001:db8::1", "fec0::1",  # reserved
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254",  # IPv4-mapped
    "2002:7f00:1::", "2002:a00:1::1",  # 6to4 of 127.0.0.1 and 10.0.0.1
    "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe",  # NAT64 of 127.0.0.1 and 169.254.169.254
    "2001:0:4136:e378:8000:63bf:80ff:fffe",  # Teredo, client 127.0.0.1
    "::127.0.0.1",  # IPv4-compatible
])
def test_non_public_addresses_are_refused(address: str, no_connect: list[str]) -> None:
    resolver = Resolver({"img.example.com": [address]})
    err = expect_error("blocked_address", fetch_url, "https://img.example.com/a.png",
                       FetchPolicy(allowed_domains=("*.example.com", "example.com")), resolver=resolver)
    assert "img.example.com" in str(err)
    assert no_connect == []


@pytest.mark.parametrize("address", [PUBLIC_IP, "8.8.8.8", "2606:4700::1111"])
def test_public_addresses_pass_the_check(address: str, no_connect: list[str]) -> None:
    resolver = Resolver({"img.example.com": [address]})
    expect_error("unreachable", fetch_url, "http://img.example.com/", FetchPolicy(allowed_domains=("*.example.com",)),
                 resolver=resolver)
    assert no_connect == [address]


@pytest.mark.parametrize("host", [
    "2130706433", "0177.0.0.1", "0x7f.0.0.1", "0x7f000001", "127.1", "127.0.1", "017700000001",
    "127.0.0.01", "0x7f.1", "1.2.3.4.5", "127.000.000.001", "0", "0x",
])
def test_odd_ipv4_literal_forms_are_refused(host: str, no_connect: list[str]) -> None:
    """Never handed to a resolver, which would read them as 127.0.0.1 (inet_aton's forms)."""
    resolver = Resolver(answers=[["127.0.0.1"]])
    policy = FetchPolicy(allowed_domains=("127.0.0.1", "*.example.com", "media.test"))
    expect_error("bad_url", fetch_url, f"http://{host}/a.png", policy, resolver=resolver)
    assert resolver.calls == [] and no_connect == []


def test_ipv4_mapped_literal_is_not_the_ipv4_entry(no_connect: list[str]) -> None:
    expect_error("not_allowed", fetch_url, "http://[::ffff:127.0.0.1]/", FetchPolicy(allowed_domains=("127.0.0.1",)))


def test_resolver_failure_is_unreachable() -> None:
    err = expect_error("unreachable", fetch_url, "http://nowhere.example.com/",
                       FetchPolicy(allowed_domains=("*.example.com",)), resolver=Resolver())
    assert "could not be resolved" in str(err)
    expect_error("unreachable", fetch_url, "http://nowhere.example.com/", FetchPolicy(allowed_domains=("*.example.com",)),
                 resolver=Resolver(answers=[["not-an-ip"]]))


# --- policy validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, shown", [
    ({"timeout_s": 0}, "0"), ({"timeout_s": -1.5}, "-1.5"), ({"timeout_s": float("nan")}, "nan"),
    ({"timeout_s": float("inf")}, "inf"), ({"timeout_s": "10"}, "'10'"), ({"timeout_s": True}, "True"),
    ({"max_bytes": 0}, "0"), ({"max_bytes": -5}, "-5"), ({"max_bytes": 1.5}, "1.5"),
    ({"max_redirects": -1}, "-1"),
    ({"allowed_domains": "example.com"}, "'example.com'"),
    ({"allowed_domains": ("",)}, "''"), ({"allowed_domains": ("http://example.com",)}, "'http://example.com'"),
    ({"allowed_domains": ("example.com/path",)}, "'example.com/path'"),
    ({"allowed_domains": ("example.com:80",)}, "'example.com:80'"), ({"allowed_domains": ("*",)}, "'*'"),
    ({"allowed_domains": ("*.",)}, "'*.'"), ({"allowed_domains": ("a.*.com",)}, "'a.*.com'"),
    ({"allowed_domains": ("user@example.com",)}, "'user@example.com'"),
    ({"allowed_domains": ("2130706433",)}, "'2130706433'"), ({"allowed_domains": ("0177.0.0.1",)}, "'0177.0.0.1'"),
    ({"allowed_domains": ("ex ample.com",)}, "'ex ample.com'"), ({"allowed_domains": (3,)}, "3"),
    ({"allowed_local_path": ""}, "''"),
])
def test_policy_validation_names_the_bad_value(kwargs: dict[str, object], shown: str) -> None:
    with pytest.raises(ValueError) as info:
        FetchPolicy(**kwargs)  # type: ignore[arg-type]
    assert shown in str(info.value)


def test_policy_normalises_domains() -> None:
    p = FetchPolicy(allowed_domains=["Media.Test.", "*.Example.com", "[::1]", "0:0::1"], allowed_local_path=Path("/srv"))  # type: ignore[arg-type]
    assert p.allowed_domains == ("media.test", "*.example.com", "::1", "::1")
    assert p.allowed_local_path == "/srv"
    assert FetchPolicy().allowed_domains == () and FetchPolicy().allowed_local_path is None
    assert dataclasses.replace(p, max_bytes=7) == FetchPolicy(p.allowed_domains, "/srv", max_bytes=7)  # idempotent


# --- rule 5: redirects ---------------------------------------------------------------------------


def _redirect(server: _Server, to: str, code: int = 302, host: str = "media.test") -> str:
    return f"http://{host}:{_port(server)}/redirect?code={code}&to={quote(to, safe='')}"


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_redirects_are_followed(server: _Server, code: int) -> None:
    got = fetch_url(_redirect(server, "/png", code), media_policy(), resolver=LOCAL)
    assert got == FetchedMedia(PNG, "image/png", f"http://media.test:{_port(server)}/png")


def test_redirect_to_another_listed_host(server: _Server) -> None:
    target = f"http://cdn.media.test:{_port(server)}/png"
    got = fetch_url(_redirect(server, target), media_policy("media.test", "cdn.media.test"), resolver=LOCAL)
    assert got.url == target and server.seen[-1]["host"] == f"cdn.media.test:{_port(server)}"


def test_redirect_limit(server: _Server) -> None:
    chain = f"http://media.test:{_port(server)}/chain/3"
    assert fetch_url(chain, media_policy(max_redirects=3), resolver=LOCAL).data == PNG
    err = expect_error("redirect", fetch_url, chain, media_policy(max_redirects=2), resolver=LOCAL)
    assert "2 redirects" in str(err)
    expect_error("redirect", fetch_url, _redirect(server, "/png"), media_policy(max_redirects=0), resolver=LOCAL)


def test_redirect_to_unlisted_host_is_refused(server: _Server) -> None:
    expect_error("not_allowed", fetch_url, _redirect(server, f"http://other.test:{_port(server)}/png"),
                 media_policy(), resolver=LOCAL)
    expect_error("not_allowed", fetch_url, _redirect(server, f"http://127.0.0.1:{_port(server)}/png"),
                 media_policy(), resolver=LOCAL)
    assert all(s["path"].startswith("/redirect?") for s in server.seen)  # no request reached /png


def test_redirect_to_private_address_is_refused(server: _Server) -> None:
    resolver = Resolver({"media.test": ["127.0.0.1"], "internal.example.com": ["10.0.0.7"]})
    err = expect_error("blocked_address", fetch_url, _redirect(server, "http://internal.example.com/admin"),
                       media_policy("media.test", "*.example.com"), resolver=resolver)
    assert "private" in str(err)
    expect_error("blocked_address", fetch_url, _redirect(server, f"http://x.media.test:{_port(server)}/png"),
                 media_policy("media.test", "*.media.test"), resolver=Resolver({"media.test": ["127.0.0.1"],
                                                                                "x.media.test": ["127.0.0.1"]}))


@pytest.mark.parametrize("prefix", ["file://", "FILE://", "file://localhost"])
def test_redirect_to_file_is_refused(server: _Server, tmp_path: Path, prefix: str) -> None:
    """Even to a file that file:// itself may read: a remote server must not choose local files."""
    (tmp_path / "x.png").write_bytes(PNG)
    policy = media_policy(allowed_local_path=str(tmp_path))
    assert fetch_url(_file_url(tmp_path / "x.png", prefix), policy).data == PNG
    err = expect_error("redirect", fetch_url, _redirect(server, _file_url(tmp_path / "x.png", prefix)), policy, resolver=LOCAL)
    assert "file" in str(err)
    expect_error("redirect", fetch_url, _redirect(server, "file:///etc/passwd"), policy, resolver=LOCAL)


def test_redirect_to_other_schemes_and_without_location(server: _Server) -> None:
    expect_error("bad_url", fetch_url, _redirect(server, "ftp://media.test/x"), media_policy(), resolver=LOCAL)
    expect_error("bad_url", fetch_url, _redirect(server, "http://user@media.test/x"), media_policy(), resolver=LOCAL)
    expect_error("redirect", fetch_url, f"http://media.test:{_port(server)}/noloc", media_policy(), resolver=LOCAL)


# --- rule 6: timeouts ----------------------------------------------------------------------------


def test_server_that_never_answers_times_out() -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody ever answers
    try:
        start = time.monotonic()
        err = expect_error("timeout", fetch_url, f"http://127.0.0.1:{listener.getsockname()[1]}/png",
                           FetchPolicy(allowed_domains=("127.0.0.1",), timeout_s=0.5))
        elapsed = time.monotonic() - start
    finally:
        listener.close()
    assert elapsed < 2.5, elapsed
    assert "0.5 s" in str(err)


def test_slow_drip_stops_at_the_overall_deadline(server: _Server) -> None:
    """One byte every 0.1 s never trips the 0.5 s read timeout; the 1.5 s deadline stops it."""
    start = time.monotonic()
    err = expect_error("timeout", fetch_url, f"http://media.test:{_port(server)}/drip", media_policy(timeout_s=0.5),
                       resolver=LOCAL)
    elapsed = time.monotonic() - start
    assert 1.3 < elapsed < 4.0, elapsed
    assert "1.5 s" in str(err)


# --- rules 7 and 8: byte cap, status ---------------------------------------------------------------


@pytest.mark.parametrize("path", ["/big-declared", "/big-chunked", "/big-close"])
def test_byte_cap(server: _Server, path: str) -> None:
    start = time.monotonic()
    err = expect_error("too_large", fetch_url, f"http://media.test:{_port(server)}{path}",
                       media_policy(max_bytes=100_000), resolver=LOCAL)
    assert "100000-byte limit" in str(err) and err.status == 413
    assert time.monotonic() - start < 4.0


def test_byte_cap_is_inclusive(server: _Server) -> None:
    url = f"http://media.test:{_port(server)}/png"
    assert fetch_url(url, media_policy(max_bytes=len(PNG)), resolver=LOCAL).data == PNG
    expect_error("too_large", fetch_url, url, media_policy(max_bytes=len(PNG) - 1), resolver=LOCAL)


def test_default_limits() -> None:
    p = FetchPolicy()
    assert (p.timeout_s, p.max_bytes, p.max_redirects) == (10.0, 20 * 1024 * 1024, 3)


@pytest.mark.parametrize("code", [404, 500, 304, 403])
def test_non_2xx_status_is_an_error(server: _Server, code: int) -> None:
    err = expect_error("http_status", fetch_url, f"http://media.test:{_port(server)}/status/{code}", media_policy(),
                       resolver=LOCAL)
    assert str(code) in str(err)


def test_host_header_and_request_target(server: _Server) -> None:
    got = fetch_url(f"HTTP://Media.Test.:{_port(server)}/host", media_policy(), resolver=LOCAL)
    assert got.data == f"media.test:{_port(server)}".encode() and got.content_type is None


# --- rule 10: messages for failures below HTTP ------------------------------------------------------


def test_connection_failures_have_safe_messages(server: _Server) -> None:
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    err = expect_error("unreachable", fetch_url, f"http://127.0.0.1:{port}/", FetchPolicy(allowed_domains=("127.0.0.1",)))
    assert "could not connect" in str(err)
    expect_error("unreachable", fetch_url, f"http://media.test:{_port(server)}/garbage", media_policy(), resolver=LOCAL)
    expect_error("unreachable", fetch_url, f"http://media.test:{_port(server)}/short", media_policy(), resolver=LOCAL)
    err = expect_error("unreachable", fetch_url, f"https://media.test:{_port(server)}/png", media_policy(), resolver=LOCAL)
    assert "TLS" in str(err)


# --- https: certificates checked against the name, not the address ----------------------------------


@pytest.fixture(scope="module")
def tls_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make a test certificate (apt-get install openssl; .ci/run does)")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=media.test",
                    "-addext", "subjectAltName=DNS:media.test"], check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.fixture
def tls_server(tls_cert: tuple[Path, Path]) -> Iterator[tuple[_Server, list[str | None]]]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(*tls_cert)
    names: list[str | None] = []
    ctx.sni_callback = lambda sock, name, c: names.append(name)  # type: ignore[assignment,func-returns-value]
    with serving(ctx) as s:
        yield s, names


def _trust(monkeypatch: pytest.MonkeyPatch, cert: Path) -> None:
    real = ssl.create_default_context
    monkeypatch.setattr(fetch_mod.ssl, "create_default_context", lambda *a, **k: real(cafile=str(cert)))


def test_https_verifies_the_certificate_against_the_host_name(tls_server, tls_cert, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    server, names = tls_server
    url = f"https://media.test:{_port(server)}/png"
    expect_error("unreachable", fetch_url, url, media_policy(), resolver=LOCAL)  # not in the system's trust store
    _trust(monkeypatch, tls_cert[0])
    got = fetch_url(url, media_policy(), resolver=LOCAL)
    assert got.data == PNG and names[-1] == "media.test"  # SNI is the name, though the socket went to 127.0.0.1
    assert server.seen[-1]["host"] == f"media.test:{_port(server)}"
    err = expect_error("unreachable", fetch_url, f"https://other.test:{_port(server)}/png", media_policy("other.test"),
                       resolver=LOCAL)  # the same server and address, under a name the certificate lacks
    assert "certificate" in str(err)
    expect_error("unreachable", fetch_url, f"https://127.0.0.1:{_port(server)}/png", media_policy("127.0.0.1"))


# --- rule 9: file:// -----------------------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "img.png").write_bytes(PNG)
    (root / "sub" / "deep.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (tmp_path / "media-evil").mkdir()
    (tmp_path / "media-evil" / "x.png").write_bytes(PNG)
    os.symlink(tmp_path / "secret.png", root / "link-out.png")
    os.symlink(root / "img.png", root / "link-in.png")
    os.symlink(tmp_path, root / "dir-out")
    return root


def _file_url(path: Path | str, prefix: str = "file://") -> str:
    return prefix + quote(str(path))


def _file_policy(root: Path, **kw: object) -> FetchPolicy:
    return FetchPolicy(allowed_local_path=str(root), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["img.png", "sub/deep.png", "link-in.png", "sub/../img.png"])
def test_file_inside_the_allowed_directory(media_dir: Path, name: str) -> None:
    url = _file_url(f"{media_dir}/{name}")
    assert fetch_url(url, _file_policy(media_dir)) == FetchedMedia(PNG, "image/png", url)


@pytest.mark.parametrize("prefix", ["file://localhost", "file://LOCALHOST", "file:"])
def test_file_url_forms(media_dir: Path, prefix: str) -> None:
    assert fetch_url(_file_url(media_dir / "img.png", prefix), _file_policy(media_dir)).data == PNG


def test_file_is_off_without_allowed_local_path(media_dir: Path) -> None:
    expect_error("disabled", fetch_url, _file_url(media_dir / "img.png"), FetchPolicy(allowed_domains=("media.test",)))


@pytest.mark.parametrize("tail", [
    "/../secret.png", "/%2e%2e/secret.png", "/%2E%2E/secret.png", "/sub/../../secret.png",
    "/link-out.png", "/dir-out/secret.png", "/../media-evil/x.png",
])
def test_file_escapes_are_refused(media_dir: Path, tail: str) -> None:
    expect_error("not_allowed", fetch_url, "file://" + quote(str(media_dir)) + tail, _file_policy(media_dir))


def test_file_outside_and_sibling_prefix(media_dir: Path) -> None:
    expect_error("not_allowed", fetch_url, "file:///etc/passwd", _file_policy(media_dir))
    expect_error("not_allowed", fetch_url, _file_url(media_dir.parent / "media-evil" / "x.png"), _file_policy(media_dir))
    expect_error("not_allowed", fetch_url, "file:///nonexistent/whatever.png", _file_policy(media_dir))


def test_file_percent_decoding_happens_once(media_dir: Path) -> None:
    (media_dir / "a b%.png").write_bytes(PNG)
    assert fetch_url("file://" + quote(str(media_dir)) + "/a%20b%25.png", _file_policy(media_dir)).data == PNG
    # %252e%252e is the literal directory name "%2e%2e", not "..": no such file
    expect_error("not_found", fetch_url, "file://" + quote(str(media_dir)) + "/%252e%252e/secret.png",
                 _file_policy(media_dir))


def test_file_not_regular_or_missing(media_dir: Path) -> None:
    expect_error("not_found", fetch_url, _file_url(media_dir / "sub"), _file_policy(media_dir))
    expect_error("not_found", fetch_url, _file_url(media_dir / "missing.png"), _file_policy(media_dir))
    if hasattr(os, "mkfifo"):
        os.mkfifo(media_dir / "pipe")
        start = time.monotonic()
        expect_error("not_found", fetch_url, _file_url(media_dir / "pipe"), _file_policy(media_dir))
        assert time.monotonic() - start < 2  # a FIFO with no writer must not block the open


def test_file_size_is_capped(media_dir: Path) -> None:
    err = expect_error("too_large", fetch_url, _file_url(media_dir / "img.png"), _file_policy(media_dir, max_bytes=10))
    assert "10-byte limit" in str(err)


@pytest.mark.parametrize("url", [
    "file://evil.test{root}/img.png", "file://127.0.0.1{root}/img.png", "file://user@localhost{root}/img.png",
    "file://localhost:80{root}/img.png", "file:img.png", "file:{root}/img.png%00.txt",
    "file:{root}/img.png?x=1", "file:{root}/%ff.png",
])
def test_bad_file_urls(media_dir: Path, url: str) -> None:
    expect_error("bad_url", fetch_url, url.format(root=quote(str(media_dir))), _file_policy(media_dir))


def test_allowed_local_path_is_itself_resolved(media_dir: Path, tmp_path: Path) -> None:
    alias = tmp_path / "alias"
    os.symlink(media_dir, alias)
    assert fetch_url(_file_url(alias / "img.png"), _file_policy(alias)).data == PNG
    expect_error("not_allowed", fetch_url, _file_url(alias / "link-out.png"), _file_policy(alias))
    expect_error("not_found", fetch_url, _file_url(media_dir / "img.png"), _file_policy(tmp_path / "gone"))


# --- sniffing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("data, expected", [
    (PNG, "image/png"),
    (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00", "image/jpeg"),
    (b"GIF89a\x01\x00\x01\x00", "image/gif"), (b"GIF87a....", "image/gif"),
    (b"RIFF\x24\x00\x00\x00WEBPVP8 ", "image/webp"),
    (b"BM" + b"\x00" * 12 + (40).to_bytes(4, "little") + b"\x00" * 8, "image/bmp"),
    (b"II*\x00\x08\x00\x00\x00", "image/tiff"), (b"MM\x00*\x00\x00\x00\x08", "image/tiff"),
    (b"RIFF\x24\x00\x00\x00WAVEfmt ", "audio/wav"),
    (b"fLaC\x00\x00\x00\x22", "audio/flac"),
    (b"ID3\x04\x00\x00\x00\x00\x00\x00", "audio/mpeg"), (b"\xff\xfb\x90\x64\x00", "audio/mpeg"),
    (b"OggS\x00\x02", "audio/ogg"),
    (b"", None), (b"<html>", None), (b"BM not a bitmap at all", None), (b"\xff\xfeh\x00i\x00", None),
    (b"RIFF\x24\x00\x00\x00AVI LIST", None),
])
def test_sniff_media_type(data: bytes, expected: str | None) -> None:
    assert sniff_media_type(data) == expected


def test_sniffs_real_images() -> None:
    for fmt, mime in [("JPEG", "image/jpeg"), ("GIF", "image/gif"), ("WEBP", "image/webp"), ("BMP", "image/bmp"),
                      ("TIFF", "image/tiff")]:
        buf = io.BytesIO()
        Image.new("RGB", (2, 2)).save(buf, format=fmt)
        assert sniff_media_type(buf.getvalue()) == mime, fmt
