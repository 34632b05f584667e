"""The values a multimodal request carries into the engine (plain data: they pickle
across the engine's process boundary and the step contract)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True, eq=False)
class MultiModalItem:
    """One processed media item (an image) of a prompt.

    ``offset`` and ``length``: the run of prompt tokens the item stands for (its
    expanded placeholder). ``embed_mask`` (bool, ``(length,)``) marks the positions of
    that run that take one of the encoder's output rows, in order; None: all of them.
    Positions not marked keep their token embeddings (the markers some families put
    around and inside an image's run). ``data``: the image processor's tensors for this
    item alone (``pixel_values``, ...), what the model's encoder reads. ``content_hash``
    names the item's content for every cache: the processed pixels, the processor's
    options and the model (`ember.multimodal.processor`), so equal hashes mean equal
    encoder outputs.
    """

    modality: str
    content_hash: str
    offset: int
    length: int
    data: dict[str, torch.Tensor] = field(repr=False)
    embed_mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """Rows of encoder output the item takes."""
        return self.length if self.embed_mask is None else int(self.embed_mask.sum())

    def embed_range(self, start: int, end: int) -> tuple[int, int]:
        """Encoder-output rows ``[first, last)`` that the prompt positions ``[start, end)``
        (clipped to the item's run) take."""
        lo, hi = max(start, self.offset) - self.offset, min(end, self.end) - self.offset
        if hi <= lo:
            return 0, 0
        if self.embed_mask is None:
            return lo, hi
        before = int(self.embed_mask[:lo].sum())
        return before, before + int(self.embed_mask[lo:hi].sum())


def embed_runs(item: MultiModalItem) -> tuple[tuple[int, int], ...]:
    """The item's runs of consecutive embedding positions, as ``(start, end)`` prompt
    positions (one run per image, or per crop or tile where markers separate them)."""
    if item.embed_mask is None:
        return ((item.offset, item.end),)
    runs, start = [], None
    for i, on in enumerate(item.embed_mask.tolist() + [False]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            runs.append((item.offset + start, item.offset + i))
            start = None
    return tuple(runs)


def overlapping(items: tuple[MultiModalItem, ...], start: int, end: int) -> list[int]:
    """Indices of the items whose run overlaps prompt positions ``[start, end)``."""
    return [i for i, item in enumerate(items) if item.offset < end and start < item.end]
