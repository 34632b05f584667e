"""What every HTTP request goes through before its route: an id, a trace, the
drain gate, the API key; and after it: metrics, the span tree, the access log.

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
from ember.api.context import RequestContext, activate, deactivate
from ember.api.errors import APIError, Flavor, error_response
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
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.tracing = tracing
        self.lifecycle = lifecycle
        self.api_key = api_key.encode("utf-8") if api_key is not None else None
        self.known_paths = known_paths

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
        if is_api:
            self.lifecycle.num_active += 1

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
            if refusal is not None:
                await error_response(refusal, flavor_of(path))(scope, receive, send_with_ids)
            else:
                await self.app(scope, receive, send_with_ids)
        except asyncio.CancelledError:
            ctx.status = ctx.status or 499
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
                    self.lifecycle.num_active -= 1
            deactivate(token)

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
