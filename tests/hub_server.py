"""A tiny Hugging Face Hub on 127.0.0.1, speaking the HTTP API huggingface_hub 2.x calls.

    GET  /api/models/{org}/{name}[/revision/{rev}]        model_info: {"id", "sha", "siblings"}
    GET  /api/models/{org}/{name}/tree/{rev}[?recursive]  list_repo_tree: [{"type": "file", "path", "size", "oid"}]
    HEAD /{org}/{name}/resolve/{rev}/{path}               X-Repo-Commit, ETag, Content-Length
    GET  /{org}/{name}/resolve/{rev}/{path}               the bytes; `Range: bytes=N-` gets 206 and the rest

It sends no X-Xet-* header, so the client downloads over plain HTTP. Errors carry
the Hub's `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo),
which huggingface_hub turns into its exception types. Knobs on `HubServer`:
`gated` (repo ids whose files need `Authorization: Bearer <token>`), `private`
(repo ids whose API answers 401), `drop` (paths whose first GET sends half the
bytes and closes the connection; further GETs answer 503 while `drop_hold`).
Every request is logged as (method, path, headers with lower-case names) in `requests`.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    branches: dict[str, str] = field(default_factory=dict)  # name -> commit sha

    @classmethod
    def from_dir(cls, directory: Path, extra: dict[str, bytes] | None = None) -> Repo:
        files = {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}
        files.update(extra or {})
        return cls(files)

    def __post_init__(self) -> None:
        if not self.branches:
            digest = hashlib.sha1(b"".join(hashlib.sha1(n.encode() + b).digest() for n, b in sorted(self.files.items())))
            self.branches = {"main": digest.hexdigest()}

    def commit(self, revision: str) -> str | None:
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.branches.values() else None


class HubServer:
    def __init__(self, repos: dict[str, Repo], token: str = "hf_test_token") -> None:
        self.repos = repos
        self.token = token
        self.gated: set[str] = set()
        self.private: set[str] = set()
        self.drop: set[str] = set()
        self.drop_hold = False
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def log(self, method: str, path: str, headers: dict[str, str]) -> None:
        with self._lock:
            self.requests.append((method, path, headers))

    def paths(self, method: str | None = None) -> list[str]:
        return [p for m, p, _ in self.requests if method is None or m == method]

    def downloaded(self) -> set[str]:
        """The repo files whose bytes were requested (GET on /resolve/)."""
        out = set()
        for method, path, _ in self.requests:
            m = _RESOLVE.match(path)
            if method == "GET" and m:
                out.add(m["path"])
        return out


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def do_GET(self) -> None:
            self._serve(head=False)

        def _error(self, status: int, code: str | None, commit: str | None = None) -> None:
            body = json.dumps({"error": code or "error"}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", code)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, payload) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _serve(self, head: bool) -> None:
            split = urlsplit(self.path)
            path = unquote(split.path)
            hub.log(self.command, path, {k.lower(): v for k, v in self.headers.items()})
            for pattern in (_TREE, _API, _RESOLVE):
                m = pattern.match(path)
                if m:
                    break
            else:
                return self._error(404, None)
            repo = hub.repos.get(m["repo"])
            if repo is None:
                return self._error(404, "RepoNotFound")
            authorised = self.headers.get("Authorization") == f"Bearer {hub.token}"
            if m["repo"] in hub.private and not authorised:
                return self._error(401, None)
            commit = repo.commit(m["rev"] or "main")
            if commit is None:
                return self._error(404, "RevisionNotFound")
            if pattern is _API:
                siblings = [{"rfilename": n, "size": len(b)} for n, b in sorted(repo.files.items())]
                return self._json({"id": m["repo"], "sha": commit, "siblings": siblings, "private": False})
            if pattern is _TREE:
                entries = [
                    {"type": "file", "path": n, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for n, b in sorted(repo.files.items())
                ]
                return self._json(entries)
            if m["repo"] in hub.gated and not authorised:
                return self._error(403, "GatedRepo")
            data = repo.files.get(m["path"])
            if data is None:
                return self._error(404, "EntryNotFound", commit)
            etag = hashlib.sha256(data).hexdigest()
            start = 0
            rng = self.headers.get("Range")
            if rng and not head:
                start = int(re.match(r"bytes=(\d+)-", rng)[1])
            if not head and m["path"] in hub.drop:
                if not rng and not getattr(hub, f"_dropped_{m['path']}", False):
                    setattr(hub, f"_dropped_{m['path']}", True)
                    self._headers(200, commit, etag, len(data))
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return None
                if hub.drop_hold:
                    return self._error(503, None)
            if start:
                self._headers(206, commit, etag, len(data) - start, f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self._headers(200, commit, etag, len(data))
            if not head:
                self.wfile.write(data[start:])
            return None

        def _headers(self, status: int, commit: str, etag: str, length: int, content_range: str | None = None):
            self.send_response(status)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{etag}"')
            self.send_header("Content-Length", str(length))
            self.send_header("Accept-Ranges", "bytes")
            if content_range:
                self.send_header("Content-Range", content_range)
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()

    return Handler
