"""Fetching media that a request names by URL: the one place Ember opens a URL on a client's behalf.

Policy (everything not listed is refused):

* http/https only when `FetchPolicy.allowed_domains` is non-empty (off by default), and only to hosts in
  it: exact names or IP literals, or `*.example.com` (subdomains only). Names compare case-insensitively,
  trailing dot ignored.
* Each hop's URL is parsed once, by `urllib.parse.urlsplit`; that one result is checked and connected to.
  Userinfo, backslashes in the authority, control characters or whitespace, bad ports and IPv4 literals in
  non-canonical forms (`2130706433`, `0177.0.0.1`, `0x7f.1`) are refused, never guessed at.
* A host is resolved once per hop; every address is checked and the socket connects to a checked address
  (no second lookup, so no DNS rebinding); `Host:` and TLS SNI/certificate checks use the name. Loopback,
  private, link-local, CGNAT, multicast, unspecified, reserved addresses, and IPv6 forms embedding one
  (IPv4-mapped, 6to4, NAT64, Teredo), are refused unless that exact host is listed (a wildcard never unlocks them).
* Redirects are followed by hand, at most `max_redirects`, each hop checked as above; never to file://.
* Connect and every read time out after `timeout_s`; the whole fetch after `_DEADLINE_FACTOR * timeout_s`.
* At most `max_bytes` are read; a larger Content-Length is refused before reading the body.
* file:// only for regular files whose real path lies inside the real `allowed_local_path` (off by default).
* Errors are `MediaFetchError`s whose text is safe to show a client; the media type comes from the bytes.
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import math
import os
import re
import socket
import ssl
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import SplitResult, quote, unquote, urljoin, urlsplit

Resolver = Callable[[str, int], list[str]]
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_DEADLINE_FACTOR = 3  # a server dripping one byte per timeout_s must not hold a worker thread for ever
_CHUNK = 64 * 1024
_MAX_URL_CHARS = 8192
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_HOST_RE = re.compile(r"[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?(?:\.[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?)*")
_NUMERIC_LABEL_RE = re.compile(r"[0-9]+|0x[0-9a-f]*")
# Not public, whatever this Python's ipaddress tables say (they changed across 3.11-3.13).
_EXTRA_BLOCKED = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "100.64.0.0/10", "192.0.0.0/24", "198.18.0.0/15", "240.0.0.0/4", "fec0::/10", "64:ff9b:1::/48"))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
          (b"GIF89a", "image/gif"), (b"II*\x00", "image/tiff"), (b"MM\x00*", "image/tiff"), (b"fLaC", "audio/flac"),
          (b"OggS", "audio/ogg"), (b"ID3", "audio/mpeg"))
REASONS = frozenset({"disabled", "not_allowed", "blocked_address", "too_large", "timeout", "unreachable",
                     "http_status", "bad_url", "not_found", "redirect"})


class MediaFetchError(ValueError):
    """A media URL that policy refuses or that could not be fetched. The text is written here, never copied
    from a lower-level exception, so it can go to the client as is; `reason` lets callers count causes."""

    def __init__(self, message: str, reason: str) -> None:
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason
        self.status = 413 if reason == "too_large" else 400

    def __reduce__(self) -> tuple[type[MediaFetchError], tuple[str, str]]:  # crosses process boundaries intact
        return type(self), (str(self), self.reason)


@dataclass(frozen=True)
class FetchPolicy:
    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None
    timeout_s: float = 10.0
    max_bytes: int = 20 * 1024 * 1024
    max_redirects: int = 3

    def __post_init__(self) -> None:
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {t!r}")
        for name in ("max_bytes", "max_redirects"):
            v, low = getattr(self, name), 1 if name == "max_bytes" else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        if isinstance(self.allowed_domains, str) or not isinstance(self.allowed_domains, (tuple, list)):
            raise ValueError(f"allowed_domains must be a sequence of host names, got {self.allowed_domains!r}")
        object.__setattr__(self, "allowed_domains", tuple(_domain_entry(d) for d in self.allowed_domains))
        path = self.allowed_local_path
        if path is not None:
            if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
                raise ValueError(f"allowed_local_path must be a directory path or None, got {path!r}")
            object.__setattr__(self, "allowed_local_path", os.fspath(path))


@dataclass(frozen=True)
class FetchedMedia:
    data: bytes
    content_type: str | None
    url: str


def sniff_media_type(data: bytes) -> str | None:
    """The type the bytes are, from their magic numbers: a header's Content-Type is the sender's claim."""
    for magic, media_type in _MAGIC:
        if data.startswith(magic):
            return media_type
    if data[:4] == b"RIFF" and data[8:12] in (b"WEBP", b"WAVE"):
        return "image/webp" if data[8:12] == b"WEBP" else "audio/wav"
    if data[:2] == b"BM" and int.from_bytes(data[14:18], "little") in (12, 40, 52, 56, 64, 108, 124):
        return "image/bmp"  # "BM" alone starts too much text: the DIB header's size must be a known one
    if len(data) >= 3 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0 and data[1] & 0x06 in (2, 4) \
            and data[2] & 0xF0 != 0xF0 and data[2] & 0x0C != 0x0C:
        return "audio/mpeg"  # an MPEG layer II/III frame with a valid bitrate and rate (FF FE is a UTF-16 BOM)
    return None


def _domain_entry(entry: object) -> str:
    """One allowed_domains entry in the form hosts are compared in, or ValueError naming it."""
    if not isinstance(entry, str):
        raise ValueError(f"allowed_domains entries must be strings, got {entry!r}")
    name = entry.strip().lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    bare = name[2:] if name.startswith("*.") else name
    if not _HOST_RE.fullmatch(bare) or _NUMERIC_LABEL_RE.fullmatch(bare.rsplit(".", 1)[-1]):
        raise ValueError(f"allowed_domains entry {entry!r} is not a host name, IP address or '*.domain' pattern")
    return name


@dataclass(frozen=True)
class _Target:
    """One hop's URL, parsed once: everything later reads these fields, never the string again."""
    url: str
    parts: SplitResult
    scheme: str
    host: str
    port: int
    ip: IPAddress | None


def _parse(url: object, base: str | None = None) -> _Target:
    """`url` (a redirect's Location when `base` is given) checked and split once, into what the hop uses."""
    if not isinstance(url, str) or not url:
        raise MediaFetchError("media URL must be a non-empty string", "bad_url")
    if len(url) > _MAX_URL_CHARS:
        raise MediaFetchError(f"media URL is longer than {_MAX_URL_CHARS} characters", "bad_url")
    # urlsplit silently drops tabs and newlines: what it would parse is not what was sent.
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        raise MediaFetchError("media URL contains whitespace or control characters", "bad_url")
    try:
        url = urljoin(base, url) if base else url
        parts = urlsplit(url)
    except ValueError:
        raise MediaFetchError("media URL is malformed", "bad_url") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https", "file"):
        shown = scheme if re.fullmatch(r"[a-z][a-z0-9+.-]{0,15}", scheme) else "?"
        raise MediaFetchError(f"{shown}: URLs are not supported (only http, https and file)", "bad_url")
    if scheme == "file":
        return _Target(url, parts, scheme, "", 0, None)
    netloc = parts.netloc
    if "@" in netloc or "\\" in netloc:
        raise MediaFetchError(f"{scheme}: URL authority must not contain user info or backslashes", "bad_url")
    raw_port = netloc.rsplit("]", 1)[-1].partition(":")[2]
    if raw_port and not (raw_port.isascii() and raw_port.isdigit() and 1 <= int(raw_port) <= 65535):
        raise MediaFetchError(f"{scheme}: URL port must be a number from 1 to 65535", "bad_url")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise MediaFetchError(f"{scheme}: URL has no host", "bad_url")
    port = int(raw_port) if raw_port else (443 if scheme == "https" else 80)
    ip: IPAddress | None = None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        # Resolvers read 2130706433, 0177.0.0.1 or 127.1 as IPv4: refuse instead of guessing as they do.
        if not _HOST_RE.fullmatch(host) or _NUMERIC_LABEL_RE.fullmatch(host.rsplit(".", 1)[-1]):
            raise MediaFetchError(f"{scheme}: URL host is not a valid host name or canonical IP address",
                                  "bad_url") from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        raise MediaFetchError(f"{scheme}: URL host must not carry an IPv6 zone", "bad_url")
    return _Target(url, parts, scheme, str(ip) if ip else host, port, ip)


def _where(t: _Target) -> str:
    return f"{t.scheme}://{'[' + t.host + ']' if ':' in t.host else t.host}"


def _allowed(t: _Target, policy: FetchPolicy) -> bool:
    """Whether policy lets this host be fetched, and whether exactly (which alone unlocks private addresses)."""
    if not policy.allowed_domains:
        raise MediaFetchError(f"{_where(t)}: remote media fetching is off; start the server with "
                              "--allowed-media-domains to allow hosts", "disabled")
    if t.host in policy.allowed_domains:
        return True
    if t.ip is None and any(d.startswith("*.") and t.host.endswith(d[1:]) for d in policy.allowed_domains):
        return False
    raise MediaFetchError(f"{_where(t)}: host is not in --allowed-media-domains", "not_allowed")


def _blocked_kind(ip: IPAddress) -> str | None:
    """Why an address is not a public one to fetch from, or None if it is."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = [ip.ipv4_mapped, ip.sixtofour, *(ip.teredo or ()),
                    ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in _NAT64 else None]
        for kind in filter(None, (_blocked_kind(v4) for v4 in filter(None, embedded))):
            return f"{kind} (IPv4 inside IPv6)"
        if ip.is_site_local:
            return "site-local"
    for attr in ("loopback", "link_local", "multicast", "unspecified", "private", "reserved"):
        if getattr(ip, f"is_{attr}"):
            return attr.replace("_", "-")
    if not ip.is_global or any(ip in n for n in _EXTRA_BLOCKED if n.version == ip.version):
        return "non-public"
    return None


def _addresses(t: _Target, exact: bool, resolve: Resolver) -> list[IPAddress]:
    """Resolve once and check every answer: the caller connects only to what this returns."""
    if t.ip is not None:
        found = [t.ip]
    else:
        try:
            answers = resolve(t.host, t.port)
            found = list(dict.fromkeys(ipaddress.ip_address(a) for a in answers))
        except (OSError, UnicodeError, ValueError, TypeError):
            raise MediaFetchError(f"{_where(t)}: host could not be resolved", "unreachable") from None
        if not found:
            raise MediaFetchError(f"{_where(t)}: host could not be resolved", "unreachable")
    if not exact:
        for ip in found:
            kind = _blocked_kind(ip)
            if kind:
                raise MediaFetchError(f"{_where(t)}: the host resolves to a {kind} address", "blocked_address")
    return found


def _system_resolver(host: str, port: int) -> list[str]:
    return [str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


def _open_socket(ip: IPAddress, port: int, timeout: float) -> socket.socket:
    """Connect to this very address (no name lookup here): a seam tests replace to see where it goes."""
    return socket.create_connection((str(ip), port), timeout=timeout)  # a numeric address: looked up by no one


class _DeadlineReader(io.RawIOBase):
    """Socket reads that each time out after timeout_s and all stop at the deadline, so no pace of
    dripping bytes outlasts it."""

    def __init__(self, sock: socket.socket, timeout: float, deadline: float) -> None:
        self._sock, self._timeout, self._deadline = sock, timeout, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        self._sock.settimeout(_remaining(self._timeout, self._deadline))
        return self._sock.recv_into(buffer)

    def makefile(self, mode: str = "rb") -> io.BufferedReader:
        return io.BufferedReader(self)


def _remaining(timeout: float, deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return min(timeout, left)


def _exchange(t: _Target, addresses: list[IPAddress], policy: FetchPolicy, deadline: float) -> str | bytes:
    """One GET to one checked address: the body, or a redirect's Location."""
    sock: socket.socket | None = None
    error: OSError = ConnectionError()
    for ip in addresses:
        try:
            sock = _open_socket(ip, t.port, _remaining(policy.timeout_s, deadline))
            break
        except OSError as exc:
            error = exc
    if sock is None:
        raise error
    try:
        if t.scheme == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=t.host)
        target = quote(t.parts.path or "/", safe="/%:@!$&'()*+,;=-._~") + (
            "?" + quote(t.parts.query, safe="/%:@!$&'()*+,;=-._~?") if t.parts.query else "")
        default = 443 if t.scheme == "https" else 80
        host = _where(t).split("://", 1)[1] + (f":{t.port}" if t.port != default else "")
        sock.settimeout(_remaining(policy.timeout_s, deadline))
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: ember-media-fetch\r\n"
                     "Accept: */*\r\nAccept-Encoding: identity\r\nConnection: close\r\n\r\n".encode("ascii"))
        response = http.client.HTTPResponse(_DeadlineReader(sock, policy.timeout_s, deadline), method="GET")  # type: ignore[arg-type]
        with response:  # closed here, not by a finalizer after the socket is gone
            return _read_response(t, response, policy)
    finally:
        sock.close()


def _read_response(t: _Target, response: http.client.HTTPResponse, policy: FetchPolicy) -> str | bytes:
    """The body of a 2xx answer, or a redirect's Location; never more than max_bytes of it."""
    response.begin()
    if response.status in _REDIRECTS:
        location = response.getheader("Location")
        if not location:
            raise MediaFetchError(f"{_where(t)}: redirect without a Location", "redirect")
        return location
    if not 200 <= response.status < 300:
        raise MediaFetchError(f"{_where(t)}: server answered HTTP {response.status}", "http_status")
    length = response.getheader("Content-Length")
    if length and length.strip().isdigit() and int(length) > policy.max_bytes:
        raise _too_large(t, policy)
    body = bytearray()
    while chunk := response.read1(_CHUNK):
        body += chunk
        if len(body) > policy.max_bytes:
            raise _too_large(t, policy)
    if response.length:  # read1() ends quietly where the peer closed before Content-Length bytes
        raise http.client.IncompleteRead(bytes(body), response.length)
    return bytes(body)


def _too_large(t: _Target, policy: FetchPolicy) -> MediaFetchError:
    return MediaFetchError(f"{_where(t)}: media is larger than the {policy.max_bytes}-byte limit", "too_large")


def _fetch_file(t: _Target, policy: FetchPolicy) -> FetchedMedia:
    if policy.allowed_local_path is None:
        raise MediaFetchError("file: local media access is off; start the server with "
                              "--allowed-local-media-path to allow a directory", "disabled")
    if t.parts.netloc.lower() not in ("", "localhost") or t.parts.query:
        raise MediaFetchError("file: URLs must name no host but localhost, and no query", "bad_url")
    try:
        path = unquote(t.parts.path, errors="strict")  # decoded once: %252e stays a literal "%2e"
    except UnicodeDecodeError:
        raise MediaFetchError("file: URL path is not valid percent-encoded UTF-8", "bad_url") from None
    if not path.startswith("/") or "\x00" in path:
        raise MediaFetchError("file: URL path must be absolute", "bad_url")
    try:
        root = Path(policy.allowed_local_path).resolve(strict=True)
        real = Path(path).resolve()  # every symlink and ".." followed, before the containment check
    except (OSError, RuntimeError, ValueError):
        raise MediaFetchError("file: local media directory is unavailable or the path is invalid", "not_found") from None
    if not real.is_relative_to(root):
        raise MediaFetchError("file: path is outside the allowed local media directory", "not_allowed")
    # O_NOFOLLOW: a symlink swapped in since resolve() is refused, not followed out of the directory.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(real, flags)
    except OSError:
        raise MediaFetchError("file: no such file, or it cannot be read", "not_found") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaFetchError("file: path is not a regular file", "not_found")
        with os.fdopen(fd, "rb", closefd=False) as f:  # st_size first; then at most one byte past the cap
            data = f.read(policy.max_bytes + 1) if info.st_size <= policy.max_bytes else b""
    finally:
        os.close(fd)
    if info.st_size > policy.max_bytes or len(data) > policy.max_bytes:
        raise MediaFetchError(f"file: media is larger than the {policy.max_bytes}-byte limit", "too_large")
    return FetchedMedia(data, sniff_media_type(data), t.url)


def _network_error(t: _Target, exc: BaseException, policy: FetchPolicy, deadline: float) -> MediaFetchError:
    """Our words for a network failure: the exception's own text may carry addresses, paths or errno names."""
    if isinstance(exc, TimeoutError):  # the last read's timeout is cut to the deadline: say which one ran out
        if time.monotonic() >= deadline:
            return MediaFetchError(f"{_where(t)}: fetch did not finish within "
                                   f"{_DEADLINE_FACTOR * policy.timeout_s:g} s", "timeout")
        return MediaFetchError(f"{_where(t)}: fetch timed out after {policy.timeout_s:g} s", "timeout")
    if isinstance(exc, ssl.SSLCertVerificationError):
        return MediaFetchError(f"{_where(t)}: the server's TLS certificate could not be verified", "unreachable")
    if isinstance(exc, ssl.SSLError):
        return MediaFetchError(f"{_where(t)}: the TLS connection failed", "unreachable")
    if isinstance(exc, http.client.HTTPException):
        return MediaFetchError(f"{_where(t)}: the server sent an invalid or incomplete HTTP response", "unreachable")
    return MediaFetchError(f"{_where(t)}: could not connect to the server, or the connection broke", "unreachable")


def fetch_url(url: str, policy: FetchPolicy, *, resolver: Resolver | None = None) -> FetchedMedia:
    """Fetch one media URL under `policy` (see the module docstring). Blocking: run it off the event loop."""
    t = _parse(url)
    if t.scheme == "file":
        return _fetch_file(t, policy)
    deadline = time.monotonic() + _DEADLINE_FACTOR * policy.timeout_s
    for hop in range(policy.max_redirects + 1):
        addresses = _addresses(t, _allowed(t, policy), resolver or _system_resolver)
        try:
            result = _exchange(t, addresses, policy, deadline)
        except (OSError, http.client.HTTPException) as exc:
            raise _network_error(t, exc, policy, deadline) from exc  # the cause stays for the server's log
        if isinstance(result, bytes):
            return FetchedMedia(result, sniff_media_type(result), t.url)
        if hop == policy.max_redirects:
            raise MediaFetchError(f"{_where(t)}: more than {policy.max_redirects} redirects", "redirect")
        nxt = _parse(result, base=t.url)
        if nxt.scheme == "file":
            raise MediaFetchError(f"{_where(t)}: redirect to a file: URL refused", "redirect")
        t = nxt
    raise AssertionError("unreachable")  # the loop returns or raises
