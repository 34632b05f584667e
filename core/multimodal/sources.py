"""What a request names as an image (a URL string, base64, a PIL image) to a decoded
image: ``data:`` URLs here, ``http(s)://`` and ``file://`` through the one fetcher
(`ember.multimodal.fetch`, its policy), then `decode_image` under the limits.

Blocking (network, disk, decoding): the server calls it in a worker thread."""

from __future__ import annotations

import base64
import binascii
import urllib.parse
from dataclasses import replace

from ember.multimodal.fetch import FetchPolicy, MediaFetchError, fetch_url
from ember.multimodal.image import decode_image
from ember.multimodal.limits import MediaError, MediaLimits


def decode_base64(text: str, limits: MediaLimits, where: str | None = None) -> bytes:
    """Base64 (standard alphabet; whitespace allowed) to bytes, the size checked first."""
    if not isinstance(text, str):
        raise MediaError(f"base64 data must be a string, got {type(text).__name__}", where)
    compact = "".join(text.split())
    if len(compact) * 3 // 4 > limits.max_image_bytes + 2:
        raise MediaError(f"image has about {len(compact) * 3 // 4} bytes, more than the limit of "
                         f"{limits.max_image_bytes}", where, 413, "max_image_bytes")
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("image data is not valid base64", where) from None


def data_url_bytes(url: str, limits: MediaLimits, where: str | None = None) -> bytes:
    """The payload of an RFC 2397 ``data:`` URL (base64 or percent-encoded)."""
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError("data: URL has no ',' before its data (RFC 2397: data:[<mediatype>][;base64],<data>)", where)
    params = [p.strip().lower() for p in header.split(";")]
    media_type = params[0] or "text/plain"
    if not media_type.startswith("image/") and media_type not in ("application/octet-stream", "text/plain"):
        raise MediaError(f"data: URL has media type {media_type!r}, not an image", where)
    if "base64" in params[1:]:
        return decode_base64(payload, limits, where)
    if len(payload) > 3 * limits.max_image_bytes:
        raise MediaError(f"image is larger than the limit of {limits.max_image_bytes} bytes", where, 413,
                         "max_image_bytes")
    return urllib.parse.unquote_to_bytes(payload)


def image_bytes_from_url(url: str, policy: FetchPolicy, limits: MediaLimits, where: str | None = None) -> bytes:
    """The encoded image a URL names: ``data:`` inline, else through the fetcher."""
    if not isinstance(url, str) or not url:
        raise MediaError("image URL must be a non-empty string", where)
    if url[:5].lower() == "data:":
        return data_url_bytes(url, limits, where)
    try:
        return fetch_url(url, replace(policy, max_bytes=min(policy.max_bytes, limits.max_image_bytes))).data
    except MediaFetchError as exc:
        too_large = exc.reason == "too_large"
        raise MediaError(str(exc), where, 413 if too_large else 400, "max_image_bytes" if too_large else None) from None


def load_image(source, policy: FetchPolicy, limits: MediaLimits, where: str | None = None):
    """An RGB ``PIL.Image.Image`` from a URL string or a PIL image (offline callers)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        limits.check_size(*source.size, where)
        return source.convert("RGB")
    if isinstance(source, (bytes, bytearray)):
        return decode_image(bytes(source), limits, where)
    if isinstance(source, str):
        return decode_image(image_bytes_from_url(source, policy, limits, where), limits, where)
    raise MediaError(f"an image must be a URL string, bytes or a PIL image, got {type(source).__name__}", where)
