"""HTTP plumbing: what every request goes through around its route, reading its body
as strict JSON, and the server-sent event stream a route answers with.

`RequestMiddleware`, before the route: an id, a trace, the drain gate, the API key,
the whole body (within --payload-limit and --request-body-timeout); after it:
metrics, the span tree, the access log. A request counts as in flight
(`Lifecycle.num_active`, which a drain waits for) only once its body has arrived: a
client that sends headers and then stalls gets 408 when the body timeout ends, holds
nothing meanwhile, and a drain ends its wait at once with a 503. A client that
disconnects during its upload is not a server error: it is counted as ``cancelled``
with error type ``client_disconnected``, logged at info. Open paths (`OPEN_PATHS`:
health, metrics, info, the OpenAPI document; GET and HEAD of the playground's page and
files) need no key, stay up while draining,
and are neither counted nor traced; every other path, plugin routes included, is an
API route.

Routes find the body already in memory. JSON is parsed strictly: no
``NaN``/``Infinity``, no number that overflows to infinity, no integer literal longer
than `MAX_INT_DIGITS`, no nesting deeper than `MAX_JSON_DEPTH` (deeper structures
would overflow the stack of whatever walks them later: a schema validator, an error
message's repr). Each is a 400 naming the problem. `unless_disconnected` runs a
handler only while its client is still connected; `EventStreamResponse` streams
server-sent events (`sse_event`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.api.auth import check_authorization
from ember.api.errors import APIError, Flavor, bad_request, error_response, from_validation_error
from ember.api.observability import CLIENT_CLOSED, RequestContext, ServerMetrics, Tracing, activate, deactivate
from ember.api.service import Lifecycle

access_logger = logging.getLogger("ember.api.access")

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

JSON_TYPES = ("application/json", "text/json")
MAX_JSON_DEPTH = 64
MAX_INT_DIGITS = 40  # no field takes more than a 64-bit integer (20 digits); a little room for sign and zeros
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

OPEN_PATHS = frozenset({"/health", "/metrics", "/info", "/openapi.json", "/docs"})
# The playground's page and files, open to GET and HEAD only (POST / is TGI's generate);
# the API calls the page makes carry the key.
OPEN_PAGES, OPEN_PAGE_PREFIX = frozenset({"/", "/ui"}), "/ui/"
REQUEST_ID_HEADER = b"x-request-id"
TRACE_ID_HEADER = b"x-trace-id"
# visible ASCII, no spaces: safe to echo in a header and to write in a log line
REQUEST_ID_PATTERN = re.compile(r"[!-~]{1,128}")


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


def check_content_type(request: Request) -> None:
    """415 for a declared content type that is not JSON (none declared is accepted, as curl -d sends)."""
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media = content_type.split(";", 1)[0].strip().lower()
        if media not in JSON_TYPES and not media.endswith("+json"):
            raise APIError(415, f"Content-Type must be application/json, got {media[:100]!r}", "unsupported_media_type")


async def read_json(request: Request) -> Any:
    """The body as JSON: 415 for a non-JSON content type, 400 for an empty body or
    one that is not strict JSON in UTF-8."""
    check_content_type(request)
    body = await request.body()
    if not body:
        raise bad_request("request body is empty; send a JSON object")
    return parse_json(body)


def parse_json(body: bytes) -> Any:
    """Strict JSON from UTF-8 bytes; `APIError` 400 naming what is wrong."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise bad_request(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise bad_request(f"JSON nested too deeply: at most {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # raised by the parse_* hooks below
        raise bad_request(f"malformed JSON: {exc}") from None
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise bad_request(f"JSON nested {depth} levels deep: at most {MAX_JSON_DEPTH} levels")
    if _SURROGATE_ESCAPE.search(body) and not _is_unicode(data):
        raise bad_request("malformed JSON: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff) that is no character")
    return data


def json_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in valid JSON ``body``; a few ms for 2 MB."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return 0  # cannot be deeper than the limit: skip the scan (the common case)
    bytes_ = np.frombuffer(_JSON_STRING.sub(b'""', body), dtype=np.uint8)  # brackets in strings do not count
    opens = (bytes_ == ord("[")) | (bytes_ == ord("{"))
    closes = (bytes_ == ord("]")) | (bytes_ == ord("}"))
    return int(np.cumsum(opens.astype(np.int32) - closes.astype(np.int32)).max(initial=0))


def _is_unicode(data: Any) -> bool:
    """No string (key or value) holds a lone surrogate, which JSON's \\u escapes allow
    but UTF-8, tokenizers and JSON output do not."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range (it overflows to infinity)")
    return value


def _bounded_int(text: str) -> int:
    num_digits = len(text.lstrip("-"))
    if num_digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer literal has {num_digits} digits; no field takes more than {MAX_INT_DIGITS}")
    return int(text)


async def read_model(request: Request, model: type[M]) -> M:
    """The body as JSON, validated as ``model`` (`read_json`, then `parse_model`)."""
    return parse_model(model, await read_json(request))


def parse_model(model: type[M], data: Any) -> M:
    """Validate strictly (no "5" for 5, no true for 1); unknown fields are refused."""
    if not isinstance(data, dict):
        raise from_validation_error_message(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def from_validation_error_message(message: str) -> APIError:
    return APIError(422, message, "validation")


async def unless_disconnected(request: Request, coro: Coroutine[Any, Any, T], poll_s: float = 0.25) -> T:
    """Run ``coro``; cancel it (which aborts its engine request) if the client leaves."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()


# -- server-sent events ------------------------------------------------------------
def sse_event(payload: dict | str) -> bytes:
    """One event; strict JSON (a NaN or infinity raises ValueError instead of leaking)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, allow_nan=False)
    return b"data: " + data.encode("utf-8") + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that always runs ``on_close`` once, whether the
    stream ended, failed, or the client disconnected before it began, and always
    closes its generator (which aborts the engine request behind it)."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._events.aclose()
            finally:
                self._on_close()


# -- the request middleware --------------------------------------------------------
def flavor_of(path: str) -> Flavor:
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return Flavor.ANTHROPIC
    return Flavor.OPENAI if path.startswith("/v1/") or path == "/rerank" else Flavor.TGI  # /rerank: vLLM's, OpenAI errors


def route_path(scope: Scope) -> str:
    """The path below the app's ``root_path`` (`--root-path`, or a parent app's mount), as
    Starlette routes it: a reverse proxy may forward the prefix or strip it."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):] or "/"
    return path


def _is_open_page(path: str, method: str) -> bool:
    return method in ("GET", "HEAD") and (path in OPEN_PAGES or path.startswith(OPEN_PAGE_PREFIX))


def _header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of a header (names are lower-case in ASGI)."""
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


class RequestMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: ServerMetrics,
        tracing: Tracing,
        lifecycle: Lifecycle,
        api_key: str | None,
        known_paths: frozenset[str],
        payload_limit: int = 2_000_000,
        body_timeout_s: float = 30.0,
        root_path: str = "",
    ) -> None:
        self.app = app
        self.root_path = root_path
        self.metrics = metrics
        self.tracing = tracing
        self.lifecycle = lifecycle
        self.api_key = api_key.encode("utf-8") if api_key is not None else None
        self.known_paths = known_paths
        self.payload_limit = payload_limit
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.root_path and not scope.get("root_path"):
            scope = {**scope, "root_path": self.root_path}  # --root-path: the routes see paths below it
        path = route_path(scope)
        refusal: APIError | None = None
        request_id = uuid.uuid4().hex
        given = _header(scope, REQUEST_ID_HEADER)
        if given is not None:
            text = given.decode("latin-1")
            if REQUEST_ID_PATTERN.fullmatch(text):
                request_id = text
            else:
                refusal = APIError(400, "x-request-id must be 1 to 128 visible ASCII characters without spaces",
                                   "bad_request", "x-request-id")
        ctx = RequestContext(request_id, path if path in self.known_paths else "other", scope["method"])
        is_api = path not in OPEN_PATHS and not _is_open_page(path, scope["method"])
        token = activate(ctx)
        span = None
        is_counted = False

        async def send_with_ids(message: Message) -> None:
            if message["type"] == "http.response.start":
                ctx.status = message["status"]
                headers = list(message.get("headers", ()))
                headers.append((REQUEST_ID_HEADER, ctx.request_id.encode("latin-1")))
                if ctx.trace_id is not None:
                    headers.append((TRACE_ID_HEADER, ctx.trace_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            if is_api:
                span = self.tracing.start_request(ctx, self._trace_headers(scope))
                refusal = refusal or self.lifecycle.refusal() or self._check_key(scope)
                if refusal is None:
                    # The whole body first: only then is the request in flight (a stalled
                    # upload holds no slot and does not delay a drain).
                    try:
                        body = await self._read_body(scope, receive)
                    except ClientDisconnected:
                        ctx.note_error(CLIENT_CLOSED, "client_disconnected")
                        ctx.status = CLIENT_CLOSED
                        return
                    except APIError as exc:
                        refusal = exc
                    else:
                        receive = _replay(body, receive)
            if refusal is not None:
                await error_response(refusal, flavor_of(path), close=True)(scope, receive, send_with_ids)
                return
            if is_api:
                self.lifecycle.num_active += 1
                is_counted = True
            await self.app(scope, receive, send_with_ids)
        except asyncio.CancelledError:
            ctx.status = ctx.status or CLIENT_CLOSED
            raise
        except Exception:
            ctx.note_error(500, "internal")
            ctx.status = ctx.status or 500
            raise
        finally:
            if is_api:
                try:
                    self._finish(ctx, span, path)
                finally:  # after the metrics and spans: num_active == 0 means all are recorded
                    if is_counted:
                        self.lifecycle.num_active -= 1
            deactivate(token)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        """The whole request body, within the payload limit and the body timeout.
        413 past the limit (at once if Content-Length says so), 408 past the timeout,
        503 if the server starts draining meanwhile; `ClientDisconnected` if the client left."""
        limit = self.payload_limit
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body of {int(declared)} bytes exceeds the payload limit of {limit} bytes",
                           "payload_too_large")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        drained = asyncio.ensure_future(self.lifecycle.wait_drain())
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                incoming = asyncio.ensure_future(receive())
                done, _ = await asyncio.wait(
                    {incoming, drained}, timeout=max(0.0, deadline - loop.time()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if incoming not in done:
                    incoming.cancel()
                    if drained in done:
                        raise self.lifecycle.refusal() or APIError(503, "the server is shutting down", "shutting_down")
                    raise APIError(
                        408, f"the request body did not arrive within {self.body_timeout_s:g} s "
                        "(--request-body-timeout)", "request_timeout",
                    )
                message = incoming.result()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnected()
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body exceeds the payload limit of {limit} bytes", "payload_too_large")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        finally:
            drained.cancel()

    def _check_key(self, scope: Scope) -> APIError | None:
        if self.api_key is None:
            return None
        return check_authorization(_header(scope, b"authorization"), self.api_key, _header(scope, b"x-api-key"))

    @staticmethod
    def _trace_headers(scope: Scope) -> dict[str, str]:
        headers = {}
        for name in (b"traceparent", b"tracestate"):
            value = _header(scope, name)
            if value is not None:
                headers[name.decode()] = value.decode("latin-1")
        return headers

    def _finish(self, ctx: RequestContext, span, path: str) -> None:
        end = time.time()
        duration = end - ctx.start_time
        try:
            self.metrics.observe_request(ctx, duration)
            self.tracing.end_request(ctx, span, end)
        except Exception:  # observability must never fail a request
            access_logger.exception("recording metrics or spans of %s failed", ctx.request_id)
        level = logging.WARNING if ctx.outcome == "server_error" else logging.INFO
        fields = {
            "method": ctx.method,
            "path": path,
            "status": ctx.status,
            "duration_s": round(duration, 6),
            "outcome": ctx.outcome,
            "error_type": ctx.error_type,
            "prompt_tokens": ctx.num_prompt_tokens,
            "generated_tokens": ctx.num_generated_tokens,
            "adapter": ctx.adapter,  # the LoRA adapter's name; None: the base model
        }
        access_logger.log(
            level, "%s %s %s %s in %.3f s (request %s%s)", ctx.method, path, ctx.status, ctx.outcome, duration,
            ctx.request_id, "" if ctx.adapter is None else f", adapter {ctx.adapter}", extra={"fields": fields},
        )


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the body already read, then the real messages
    (a disconnect) after it."""
    is_sent = False

    async def replay() -> Message:
        nonlocal is_sent
        if not is_sent:
            is_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
