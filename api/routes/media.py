"""What the generation routes share for images (docs/multimodal.md): the served model's
media processor, loading and processing a request's images off the event loop, and
every `MediaError` as the API's 400 (413 for an image over the byte limit) naming the
request's part and the limit's flag.

A route prepares a request on a preparation thread as before; when the prompt holds
images, preparing stops at the tokenized prompt and returns `NeedsMedia`: `complete`
then loads the images and runs the model's image processor (each on a preparation
thread, never on the event loop, never in the engine's step) and finishes the request
with the expanded prompt. A request without images takes the same single hop as before.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ember.api.errors import APIError
from ember.api.service import GenerationService
from ember.multimodal.chat import ImageRef, no_images_error
from ember.multimodal.fetch import FetchPolicy
from ember.multimodal.limits import MediaError, MediaLimits

T = TypeVar("T")
U = TypeVar("U")

# TGI's way of putting images in `inputs`: markdown images, `![](url)` (an alt text is allowed)
MARKDOWN_IMAGE = re.compile(r"!\[[^\]\n]*\]\(([^)\s]*)\)")


# the flag that sets each limit a `MediaError` names (its ``limit``)
LIMIT_FLAGS = {"max_image_pixels": "--max-image-pixels", "max_image_bytes": "--max-image-bytes"}


@dataclass(frozen=True, slots=True)
class NeedsMedia(Generic[T]):
    """A request prepared up to its images. ``ids``: the tokenized prompt, one placeholder
    per image; ``where``: the field the prompt came from (named when the placeholders and
    images disagree); ``finish(expanded_ids, mm_items)``: the rest of the preparation (limits,
    sampling parameters, validation), run on a preparation thread. ``text`` (the prompt the
    ids were tokenized from, with ``special`` tokens or not): placeholders are expanded in
    it and the whole tokenized once, as the model's own processor does."""

    ids: list[int]
    images: list[ImageRef]
    where: str
    finish: Callable[[list[int], tuple], T]
    text: str | None = None
    special: bool = False

    def then(self, fn: Callable[[T], U]) -> NeedsMedia[U]:
        """The same request, ``fn`` applied to what `finish` gives."""
        return NeedsMedia(self.ids, self.images, self.where, lambda ids, items: fn(self.finish(ids, items)),
                          self.text, self.special)


def then(result: T | NeedsMedia[T], fn: Callable[[T], U]) -> U | NeedsMedia[U]:
    """``fn(result)``, or once its images are in (`NeedsMedia.then`)."""
    return result.then(fn) if isinstance(result, NeedsMedia) else fn(result)


async def complete(service: GenerationService, result: T | NeedsMedia[T]) -> T:
    """A prepared request; a `NeedsMedia` one after its images are loaded and processed."""
    if not isinstance(result, NeedsMedia):
        return result
    ids, items = await service.media.expand(result.ids, result.images, result.where, result.text, result.special)
    return await service.run_blocking(result.finish, ids, items)


def relocated(exc: MediaError, places: dict[str, str] | None) -> MediaError:
    """``exc`` naming the part of the client's request (``places``: the chat request's
    part -> the part it was made from, for the Messages and Responses APIs)."""
    where = (places or {}).get(exc.where or "")
    if where is None:
        return exc
    message = str(exc).removeprefix(f"`{exc.where}`: ")
    return MediaError(message, where, exc.status, exc.limit)


class ServerMedia:
    """The served model's images: its media processor (built at the first image; None
    for a text-only model), the limits and fetch policy of `ember serve`'s flags
    (`ember.api.media`), and `expand`. Shared by every request (thread-safe)."""

    def __init__(self, client: Any, model_name: str, limits: MediaLimits, policy: FetchPolicy,
                 model_impl: str, run_blocking: Callable[..., Awaitable[Any]]) -> None:
        self.client = client
        self.model_name = model_name
        self.limits = limits
        self.policy = policy
        self.model_impl = model_impl
        self.run_blocking = run_blocking
        self._lock = threading.Lock()
        self._built = False
        self._processor = None

    @property
    def processor(self):
        """The model's `MultiModalProcessor`, None for a model that takes no images. Built
        once, on a preparation thread (it reads the checkpoint's image processor)."""
        with self._lock:
            if not self._built:
                from ember.models.loader import load_hf_config
                from ember.models.vision_language import create_multimodal_processor

                model_dir = self.client.model_info.model_dir
                registry = self.client.plugin_manager.registries.model_architectures
                self._processor = create_multimodal_processor(model_dir, load_hf_config(model_dir), registry,
                                                              self.limits, self.model_impl,
                                                              getattr(self.client, "tokenizer", None))
                self._built = True
            return self._processor

    @property
    def image_text(self) -> str | None:
        """What an image becomes in a chat's text (the model's placeholder); None: no images."""
        processor = self.processor
        return None if processor is None else processor.spec.prompt_text

    def no_images(self, where: str) -> APIError:
        return self.error(no_images_error(self.model_name, where))

    def error(self, exc: MediaError) -> APIError:
        """A refusal as the API's error: 400 (413 for too many bytes), the part as ``param``,
        and the flag that sets the limit it hit."""
        message = str(exc)
        flag = LIMIT_FLAGS.get(exc.limit or "")
        if flag is not None and flag not in message:
            message += f" (the server's {flag})"
        return APIError(exc.status, message, "payload_too_large" if exc.status == 413 else "bad_request", exc.where)

    async def expand(self, ids: list[int], images: list[ImageRef], where: str, text: str | None = None,
                     special: bool = False) -> tuple[list[int], tuple]:
        """The prompt with each image's placeholder expanded and the images' items: the
        count checked first (naming the first image past the limit), then every image
        loaded, then processed, each on a preparation thread."""
        try:
            limit = self.limits.max_items("image")
            if len(images) > limit:
                self.limits.check_count("image", len(images), images[limit].where)
            loaded = await self.run_blocking(self.load, images)
            return await self.run_blocking(self.process, ids, loaded, where, text, special)
        except MediaError as exc:
            raise self.error(exc) from None

    def load(self, images: list[ImageRef]) -> list:
        """Each image decoded (``data:`` URLs, or fetched under the policy); blocking."""
        from ember.multimodal.sources import load_image

        return [load_image(ref.source, self.policy, self.limits, ref.where) for ref in images]

    def process(self, ids: list[int], images: list, where: str, text: str | None = None,
                special: bool = False) -> tuple[list[int], tuple]:
        processor = self.processor
        if processor is None:  # the routes ask `image_text` first: only a misuse lands here
            raise no_images_error(self.model_name, where)
        return processor.process(ids, images, where, text=text, add_special_tokens=special)


def markdown_images(text: str, image_text: str, where: str) -> tuple[str, list[ImageRef]]:
    """TGI's ``inputs``: each markdown image (``![](url)``) becomes ``image_text`` in place,
    and an `ImageRef` to its URL, in order."""
    images: list[ImageRef] = []

    def replace(match: re.Match) -> str:
        images.append(ImageRef(match.group(1), where))
        return image_text

    return MARKDOWN_IMAGE.sub(replace, text), images
