"""The API key: ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``), compared in constant time."""

from __future__ import annotations

import hmac

from ember.api.errors import APIError

SCHEME = b"bearer"


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "unauthorized")


def check_authorization(header: bytes | None, key: bytes, x_api_key: bytes | None = None) -> APIError | None:
    """None if ``header`` (the raw Authorization value) carries ``key``; else the 401 to send.
    Without an Authorization header, an ``x-api-key`` header (Anthropic's clients) is read instead.

    Missing, malformed (not ``Bearer <token>``) and wrong keys each get their own
    message; none of them echoes what was sent.
    """
    if header is None and x_api_key is not None:
        return None if hmac.compare_digest(x_api_key.strip(), key) else unauthorized("invalid API key")
    if header is None:
        return unauthorized("missing API key: send the header `Authorization: Bearer <key>`")
    scheme, _, token = header.strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != SCHEME or not token or b" " in token:
        return unauthorized("malformed Authorization header: expected `Authorization: Bearer <key>`")
    if not hmac.compare_digest(token, key):
        return unauthorized("invalid API key")
    return None
