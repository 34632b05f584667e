"""Log records that carry the request: its id and trace id, as text or one JSON object a line.

`RequestContextFilter` stamps every record with the current request's id and trace
id (None outside a request, e.g. in the engine thread). `JsonFormatter` writes
``{"timestamp", "level", "logger", "request_id", "trace_id", "message", "fields"}``;
``fields`` holds what the call passed as ``extra={"fields": {...}}``, and the
traceback when there is one.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _current_request():
    """The current request's context, or None. Looked up without importing
    `ember.api.observability` (it imports torch, Prometheus and OpenTelemetry, which
    the CLI's offline commands do not need): until a server imports it, no request is current."""
    current_of_server = getattr(sys.modules.get("ember.api.observability"), "current", None)
    return None if current_of_server is None else current_of_server()


class RequestContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _current_request()
        if not hasattr(record, "request_id"):
            record.request_id = ctx.request_id if ctx is not None else None
        if not hasattr(record, "trace_id"):
            record.trace_id = ctx.trace_id if ctx is not None else None
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = dict(getattr(record, "fields", None) or {})
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        payload = {
            "timestamp": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", None),
            "trace_id": getattr(record, "trace_id", None),
            "message": record.getMessage(),
            "fields": fields,
        }
        return json.dumps(payload, ensure_ascii=False, default=str)


def create_handler(stream, json_output: bool) -> logging.Handler:
    handler = logging.StreamHandler(stream)
    handler.addFilter(RequestContextFilter())
    handler.setFormatter(JsonFormatter() if json_output else logging.Formatter(TEXT_FORMAT, "%H:%M:%S"))
    return handler


@contextmanager
def log_to_stderr(level: str, json_output: bool = False) -> Iterator[None]:
    """Send the `ember` logger to stderr at `level` for the duration of one command;
    restore it afterwards so that `main` called in-process leaves logging as it was.
    With ``json_output`` uvicorn's own logger goes through the same JSON handler, so
    that every line on stderr is one JSON object."""
    handler = create_handler(sys.stderr, json_output)
    loggers = [logging.getLogger("ember")] + ([logging.getLogger("uvicorn")] if json_output else [])
    previous = [(logger, logger.level, logger.propagate) for logger in loggers]
    loggers[0].setLevel(level.upper())
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = logger.propagate and not json_output
    try:
        yield
    finally:
        for logger, previous_level, propagate in previous:
            logger.removeHandler(handler)
            logger.setLevel(previous_level)
            logger.propagate = propagate
