"""What every HTTP request goes through before its route: an id, a trace, the
drain gate, the API key, its whole body (within --payload-limit and
--request-body-timeout); and after it: metrics, the span tree, the access log.

A request counts as in flight (`Lifecycle.num_active`, which a drain waits for) only
once its body has arrived: a client that sends headers and then stalls gets 408 when
the body timeout ends, holds nothing meanwhile, and a drain ends its wait at once with
a 503. A client that disconnects during its upload is not a server error: it is
counted as ``cancelled`` with error type ``client_disconnected``, logged at info.

Open paths (`OPEN_PATHS`: health, metrics, info, the OpenAPI document) need no key,
stay up while draining, and are neither counted nor traced; every other path,
plugin routes included, is an API route.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.api.auth import check_authorization
from ember.api.context import CLIENT_CLOSED, RequestContext, activate, deactivate
from ember.api.errors import APIError, Flavor, error_response
from ember.api.http import ClientDisconnected
from ember.api.lifecycle import Lifecycle
from ember.api.metrics import ServerMetrics
from ember.api.tracing import Tracing

access_logger = logging.getLogger("ember.api.access")

OPEN_PATHS = frozenset({"/health", "/metrics", "/info", "/openapi.json", "/docs"})
REQUEST_ID_HEADER = b"x-request-id"
TRACE_ID_HEADER = b"x-trace-id"
# visible ASCII, no spaces: safe to echo in a header and to write in a log line
REQUEST_ID_PATTERN = re.compile(r"[!-~]{1,128}")


def flavor_of(path: str) -> Flavor:
    return Flavor.OPENAI if path.startswith("/v1/") else Flavor.TGI


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
    ) -> None:
        self.app = app
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
        path: str = scope["path"]
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
        is_api = path not in OPEN_PATHS
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
        return check_authorization(_header(scope, b"authorization"), self.api_key)

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
        }
        access_logger.log(
            level, "%s %s %s %s in %.3f s (request %s)", ctx.method, path, ctx.status, ctx.outcome, duration,
            ctx.request_id, extra={"fields": fields},
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
