"""A chat message's content parts (OpenAI's shape) to the text the chat template
sees and the images it names, in order.

Each image part becomes the model's ``prompt_text`` (`MultiModalSpec`: its
placeholder, with any markers around it) at its place in the text, so any chat
template that takes string content places images where the user put them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.multimodal.limits import MediaError


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image a request names: ``source`` (a URL string: ``data:``, ``http(s)://``,
    ``file://``; or a PIL image offline) and where in the request it stands."""

    source: object
    where: str
    detail: str | None = None


DETAILS = ("auto", "low", "high")


def no_images_error(model: str | None, where: str) -> MediaError:
    return MediaError(f"model {model or 'the default model'!r} takes no images (it is a text-only model)", where)


def join_openai_parts(parts: list, image_text: str | None, where: str, model: str | None = None
                      ) -> tuple[str, list[ImageRef]]:
    """OpenAI chat content parts (dicts or objects with ``type``) to ``(text, images)``.
    ``text`` parts are joined by newlines, as Ember joins text parts; an ``image_url``
    part becomes ``image_text`` (None: the model takes no images, a MediaError)."""
    pieces: list[str] = []
    images: list[ImageRef] = []
    for k, part in enumerate(parts):
        here = f"{where}[{k}]"
        kind = _get(part, "type")
        if kind == "text":
            text = _get(part, "text")
            if not isinstance(text, str):
                raise MediaError("a text part needs a string `text`", here)
            pieces.append(text)
        elif kind in ("image_url", "image"):
            if image_text is None:
                raise no_images_error(model, here)
            if kind == "image":  # offline: {"type": "image", "image": <PIL image or URL>}
                source, detail = _get(part, "image"), None
            else:
                spec = _get(part, "image_url")
                source = spec if isinstance(spec, str) else _get(spec, "url")
                detail = None if isinstance(spec, str) else _get(spec, "detail")
            if not isinstance(source, str) and kind == "image_url":
                raise MediaError("an image_url part needs `image_url.url` (a data:, http(s):// or file:// URL)", here)
            if detail is not None and detail not in DETAILS:
                raise MediaError(f"`detail` must be one of {', '.join(DETAILS)}, got {detail!r}", here)
            images.append(ImageRef(source, here, detail))
            pieces.append(image_text)
        else:
            supported = '"text" and "image_url"' if image_text is not None else '"text"'
            raise MediaError(f"part has type {kind!r}: only {supported} parts are supported", here)
    return "\n".join(pieces), images


def _get(part, name: str):
    return part.get(name) if isinstance(part, dict) else getattr(part, name, None)
