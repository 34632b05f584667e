"""API errors and their three JSON shapes.

TGI routes answer ``{"error": message, "error_type": type}``; OpenAI routes answer
``{"error": {"message", "type", "param", "code"}}``; Anthropic routes (/v1/messages) answer
``{"type": "error", "error": {"type", "message"}}``. Every failure a client can
cause is an `APIError` with a 4xx status; anything else is a 500 that names no
internals beyond the exception's message.
"""

from __future__ import annotations

import enum
import json

from pydantic import ValidationError
from starlette.responses import JSONResponse

from ember.api.observability import current


class Flavor(enum.Enum):
    TGI = "tgi"
    OPENAI = "openai"
    ANTHROPIC = "anthropic"


class APIError(Exception):
    def __init__(self, status: int, message: str, error_type: str = "validation", param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "bad_request", param)


def validation_error(message: str, param: str | None = None) -> APIError:
    return APIError(422, message, "validation", param)


def not_available(param: str, issue: str = "a later release") -> APIError:
    return APIError(
        422,
        f"`{param}` is not available yet in Ember (planned for {issue}); remove it from the request",
        "validation",
        param,
    )


def overloaded() -> APIError:
    return APIError(429, "Model is overloaded", "overloaded")


OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    408: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "service_unavailable",
}


ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_body(exc: APIError, flavor: Flavor) -> dict:
    if flavor is Flavor.TGI:
        return {"error": exc.message, "error_type": exc.error_type}
    if flavor is Flavor.ANTHROPIC:  # /v1/messages: {"type": "error", "error": {"type", "message"}}
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(exc.status, "invalid_request_error"),
                                           "message": exc.message}}
    return {
        "error": {
            "message": exc.message,
            "type": OPENAI_TYPES.get(exc.status, "invalid_request_error"),
            "param": exc.param,
            "code": exc.error_type if exc.status != 429 else "overloaded",
        }
    }


def note_error(exc: APIError) -> None:
    """Tell the current request's context (metrics, span, access log) how it failed."""
    ctx = current()
    if ctx is not None:
        ctx.note_error(exc.status, exc.error_type)


def error_response(exc: APIError, flavor: Flavor, *, close: bool = False) -> JSONResponse:
    """The error as JSON; ``close``: end the connection after it (a body left unread)."""
    note_error(exc)
    return JSONResponse(error_body(exc, flavor), status_code=exc.status, headers={"connection": "close"} if close else None)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error, as a 422 naming the field and the value."""
    first = exc.errors(include_url=False)[0]
    loc = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    message = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        message = f"unknown field `{loc}`"
    elif first.get("type") == "missing":
        message = f"missing field `{loc}`"
    else:
        value = first.get("input")
        shown = json.dumps(value)[:80] if _is_json(value) else repr(value)[:80]
        message = f"`{loc}`: {message} (got {shown})" if loc else message
    return validation_error(message, loc or None)


def _is_json(value: object) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def sse_error_event(exc: APIError, flavor: Flavor) -> bytes:
    note_error(exc)
    return b"data: " + json.dumps(error_body(exc, flavor), allow_nan=False).encode() + b"\n\n"
