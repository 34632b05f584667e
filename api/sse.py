"""Server-sent events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


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
