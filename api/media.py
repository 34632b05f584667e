"""Images at the API (docs/multimodal.md): the `ember serve` flags that bound what a
request may send (vLLM's names: --limit-mm-per-prompt, --allowed-media-domains,
--allowed-local-media-path, --media-fetch-timeout; Ember's --max-image-bytes and
--max-image-pixels; the engine's --encoder-cache-size), their checks, and the
`MediaLimits` and `FetchPolicy` they make.

Standard library only at import: the CLI parses these before anything heavy is
imported (and `ember.api.settings` imports this module, so it imports no other module of
the CLI). The routes' shared media plumbing (loading, processing, errors) is
`ember.api.routes.media`."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

DEFAULT_IMAGES_PER_PROMPT = 4
DEFAULT_FETCH_TIMEOUT_S = 10.0
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000


def _hosts_argument(values: str) -> list[str]:
    hosts = [name.strip() for name in values.split(",") if name.strip()]
    if not hosts:  # an empty value allows nothing: say so rather than ignore it
        raise argparse.ArgumentTypeError("expected host names or IP addresses, comma-separated")
    return hosts


def add_media_arguments(parser: argparse.ArgumentParser) -> None:
    """`ember serve`'s image flags (their variables: `ember.api.cli_env`)."""
    group = parser.add_argument_group("images (docs/multimodal.md)")
    group.add_argument(
        "--limit-mm-per-prompt", metavar="image=N", default=None,
        help=f"images one prompt may hold (default image={DEFAULT_IMAGES_PER_PROMPT}; vLLM's flag) "
        "[EMBER_LIMIT_MM_PER_PROMPT]",
    )
    group.add_argument(
        "--allowed-media-domains", metavar="HOST", type=_hosts_argument, action="extend", default=None,
        help="hosts whose http(s) image URLs the server may fetch: names, IP addresses or *.domain (repeatable, "
        "or comma-separated; default none: remote fetching is off) [EMBER_ALLOWED_MEDIA_DOMAINS]",
    )
    group.add_argument(
        "--allowed-local-media-path", metavar="DIR", default=None,
        help="a directory whose files requests may name by file:// URL (default: none, file:// is off) "
        "[EMBER_ALLOWED_LOCAL_MEDIA_PATH]",
    )
    group.add_argument(
        "--media-fetch-timeout", metavar="SECONDS", type=float, default=None,
        help=f"time limit of each connect and read of an image fetch (default {DEFAULT_FETCH_TIMEOUT_S:g}) "
        "[EMBER_MEDIA_FETCH_TIMEOUT]",
    )
    group.add_argument(
        "--max-image-bytes", metavar="SIZE", default=None,  # a size such as 5MiB: `ServerSettings` reads it
        help="largest encoded image, e.g. 5MiB (default 20MiB; the request body is also bounded by "
        "--payload-limit) [EMBER_MAX_IMAGE_BYTES]",
    )
    group.add_argument(
        "--max-image-pixels", metavar="N", type=int, default=None,
        help=f"largest image in width x height, read from its header before decoding (default "
        f"{DEFAULT_MAX_IMAGE_PIXELS}) [EMBER_MAX_IMAGE_PIXELS]",
    )
    group.add_argument(
        "--encoder-cache-size", metavar="N", type=int, default=None,
        help="image embeddings the engine's encoder cache holds (default: 8192 or a step's token budget, "
        "the larger) [EMBER_ENCODER_CACHE_SIZE]",
    )


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_media_options(settings: Any) -> None:
    """ValueError naming the flag for a bad image option of `ServerSettings` (before
    anything loads, so `ember serve` exits 2)."""
    from ember.multimodal.fetch import FetchPolicy
    from ember.multimodal.limits import parse_limit_mm_per_prompt

    parse_limit_mm_per_prompt(settings.limit_mm_per_prompt)  # its errors name --limit-mm-per-prompt
    timeout = settings.media_fetch_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"--media-fetch-timeout must be a number of seconds > 0, got {timeout!r}")
    for name in ("max_image_bytes", "max_image_pixels"):
        if not _positive_int(getattr(settings, name)):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(settings, name)!r}")
    size = settings.encoder_cache_size
    if size is not None and not _positive_int(size):
        raise ValueError(f"--encoder-cache-size must be a positive number of embeddings, got {size!r}")
    try:
        FetchPolicy(tuple(settings.allowed_media_domains))
    except ValueError as exc:
        raise ValueError(f"--allowed-media-domains: {exc}".replace("allowed_domains entry", "entry")) from None
    path = settings.allowed_local_media_path
    if path is not None and (not isinstance(path, str) or not path or not os.path.isdir(path)):
        raise ValueError(f"--allowed-local-media-path {path!r} is not a directory")


def media_limits(settings: Any):
    """The `MediaLimits` of the settings (`ember.multimodal.limits`)."""
    from ember.multimodal.limits import MediaLimits, parse_limit_mm_per_prompt

    return MediaLimits(parse_limit_mm_per_prompt(settings.limit_mm_per_prompt),
                       default_per_prompt=DEFAULT_IMAGES_PER_PROMPT, max_image_bytes=settings.max_image_bytes,
                       max_image_pixels=settings.max_image_pixels)


def fetch_policy(settings: Any):
    """The `FetchPolicy` of the settings: remote hosts and a local folder only where allowed."""
    from ember.multimodal.fetch import FetchPolicy

    return FetchPolicy(tuple(settings.allowed_media_domains), settings.allowed_local_media_path,
                       timeout_s=float(settings.media_fetch_timeout), max_bytes=settings.max_image_bytes)

