"""What a request may send: items per prompt, bytes and pixels per image; and the
error every refusal raises."""

from __future__ import annotations

from dataclasses import dataclass, field

MODALITIES = ("image",)


class MediaError(ValueError):
    """A media item Ember refuses. ``where`` names the part of the request
    (``messages[0].content[1]``), ``status`` the HTTP status the API answers with.
    The message is safe to show a client: it names the part and the limit, never a
    decoder's own text or a memory address. ``limit``: the `MediaLimits` field it hit
    (``max_image_pixels``, ...), None for other refusals (the server names its flag)."""

    def __init__(self, message: str, where: str | None = None, status: int = 400, limit: str | None = None) -> None:
        super().__init__(f"`{where}`: {message}" if where else message)
        self.where = where
        self.status = status
        self.limit = limit


def parse_limit_mm_per_prompt(value: str | dict | None) -> dict[str, int]:
    """``--limit-mm-per-prompt``: vLLM's ``image=4`` (comma-separated for several
    modalities) or its JSON-like dict; ValueError naming a bad entry."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        entries: dict[str, object] = {}
        for piece in value.split(","):
            name, sep, count = piece.partition("=")
            if not sep:
                raise ValueError(f"--limit-mm-per-prompt takes MODALITY=N[,MODALITY=N], got {piece!r}")
            entries[name.strip()] = count.strip()
        value = entries
    out: dict[str, int] = {}
    for name, count in value.items():
        if name not in MODALITIES:
            raise ValueError(f"--limit-mm-per-prompt: unknown modality {name!r} (known: {', '.join(MODALITIES)})")
        try:
            number = int(count)
        except (TypeError, ValueError):
            raise ValueError(f"--limit-mm-per-prompt: {name}={count!r} is not an integer") from None
        if number < 0:
            raise ValueError(f"--limit-mm-per-prompt: {name}={number} must be >= 0")
        out[name] = number
    return out


@dataclass(frozen=True)
class MediaLimits:
    """Per-request media limits (checked before any decoding or model work).

    ``per_prompt``: items of each modality one prompt may hold (vLLM's
    ``--limit-mm-per-prompt``; absent modalities take ``default_per_prompt``).
    ``max_image_bytes``: an image's encoded size (base64 decoded, or as fetched).
    ``max_image_pixels``: width x height as the file's header states it, checked
    before the pixels are decoded (a decompression bomb never allocates its canvas).
    """

    per_prompt: dict[str, int] = field(default_factory=dict)
    default_per_prompt: int = 4
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    # an image's long side over its short side, at most: image processors resize the short
    # side to the model's size first, so a 1 x 200000 strip (well under the pixel cap) would
    # take gigabytes on its way to a small square (Qwen2-VL's processor refuses over 200 too)
    max_aspect_ratio: int = 200

    def __post_init__(self) -> None:
        for name in ("default_per_prompt", "max_image_bytes", "max_image_pixels", "max_aspect_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "default_per_prompt" else 1):
                raise ValueError(f"MediaLimits.{name} must be a positive integer, got {value!r}")

    def check_size(self, width: int, height: int, where: str | None = None) -> None:
        """MediaError for an image with no pixels, more than the pixel cap, or too narrow."""
        if width < 1 or height < 1:
            raise MediaError(f"image has no pixels ({width}x{height})", where)
        if width * height > self.max_image_pixels:
            raise MediaError(f"image is {width}x{height} = {width * height} pixels, more than the limit of "
                             f"{self.max_image_pixels}", where, limit="max_image_pixels")
        if max(width, height) > self.max_aspect_ratio * min(width, height):
            raise MediaError(f"image is {width}x{height}: an aspect ratio over {self.max_aspect_ratio}:1 is refused "
                             "(the model's processor would resize it to a huge canvas)", where)

    def max_items(self, modality: str) -> int:
        return self.per_prompt.get(modality, self.default_per_prompt)

    def check_count(self, modality: str, count: int, where: str | None = None) -> None:
        limit = self.max_items(modality)
        if count > limit:
            raise MediaError(
                f"the prompt has {count} {modality}s, more than the limit of {limit} per prompt "
                f"(the server's --limit-mm-per-prompt {modality}=N)", where,
            )
