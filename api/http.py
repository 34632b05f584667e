"""Reading requests safely: content type, payload limit, UTF-8, JSON, schema;
and running a handler only while its client is still connected."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from ember.api.errors import APIError, bad_request, from_validation_error

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

JSON_TYPES = ("application/json", "text/json")


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


async def read_json(request: Request, payload_limit: int) -> Any:
    """The body as JSON. 415 for a non-JSON content type, 413 past the payload
    limit, 400 for bytes that are not UTF-8 or not JSON."""
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media = content_type.split(";", 1)[0].strip().lower()
        if media not in JSON_TYPES and not media.endswith("+json"):
            raise APIError(415, f"Content-Type must be application/json, got {media!r}", "unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > payload_limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the payload limit of {payload_limit} bytes", "payload_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > payload_limit:
            raise APIError(413, f"request body exceeds the payload limit of {payload_limit} bytes", "payload_too_large")
    if not body:
        raise bad_request("request body is empty; send a JSON object")
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None


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
