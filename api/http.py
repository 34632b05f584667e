"""Reading requests safely: content type, UTF-8, strict JSON, schema; and running a
handler only while its client is still connected.

The body itself was read by `RequestMiddleware` (within --request-body-timeout and
--payload-limit) before any route runs, so here it is already in memory. JSON is
parsed strictly: no ``NaN``/``Infinity``, no number that overflows to infinity, no
integer literal longer than `MAX_INT_DIGITS`, no nesting deeper than
`MAX_JSON_DEPTH` (deeper structures would overflow the stack of whatever walks them
later: a schema validator, an error message's repr). Each is a 400 naming the problem.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from ember.api.errors import APIError, bad_request, from_validation_error

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

JSON_TYPES = ("application/json", "text/json")
MAX_JSON_DEPTH = 64
MAX_INT_DIGITS = 40  # no field takes more than a 64-bit integer (20 digits); a little room for sign and zeros
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


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
