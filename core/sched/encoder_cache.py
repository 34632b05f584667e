"""The encoder cache's bookkeeping: which images' encoder outputs the runner holds.

Entries are keyed by an item's content hash (`ember.multimodal.inputs.MultiModalItem`),
so an image is encoded once across requests, ``n`` siblings, beams and preemptions
while its entry lives. The runner holds the tensors; this side decides, plain Python
like the KV manager beside it:

* an entry is *referenced* by every running request whose computed tokens have not
  yet passed the image's run (it will read rows of it); a request drops its
  reference once its run is computed, or when it finishes or is preempted;
* unreferenced entries stay, least recently used first out, until room is needed:
  the capacity is counted in embeddings (encoder output rows), not bytes;
* evicted hashes are handed to the runner with the next step (`take_freed`), before
  it encodes anything new.

Invariant: ``used`` is the sum of the entries' sizes and never exceeds ``capacity``;
an entry with references is never evicted.
"""

from __future__ import annotations

from collections import OrderedDict

from ember.multimodal.inputs import MultiModalItem


class EncoderCacheManager:
    """``whole_runs``: the model's image tokens attend to each other both ways (Gemma 3), so
    each run of them is computed within one step (`ember.sched.encoder_planner`)."""

    def __init__(self, capacity: int, whole_runs: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"encoder cache capacity must be >= 1 embedding, got {capacity}")
        self.capacity = capacity
        self.whole_runs = whole_runs
        self.entries: OrderedDict[str, int] = OrderedDict()  # hash -> embeddings, least recently used first
        self.refs: dict[str, set[str]] = {}  # hash -> ids of the requests that still read it
        self.used = 0
        self._freed: list[str] = []
        self.num_hits = 0  # items found encoded (counted once per request and item)
        self.num_encoded = 0

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self.entries

    def check_fits(self, item: MultiModalItem) -> None:
        """ValueError if the item could never be cached (larger than the whole cache)."""
        if item.num_embeds > self.capacity:
            raise ValueError(f"an image takes {item.num_embeds} embeddings, more than the encoder cache holds "
                             f"({self.capacity}); raise --encoder-cache-size or send a smaller image")

    def room_for(self, num_embeds: int, keep: set[str] = frozenset()) -> bool:
        """Whether ``num_embeds`` more fit after evicting unreferenced entries (not those in ``keep``)."""
        evictable = sum(size for h, size in self.entries.items() if not self.refs.get(h) and h not in keep)
        return self.capacity - self.used + evictable >= num_embeds

    def add_ref(self, request_id: str, content_hash: str) -> None:
        self.refs.setdefault(content_hash, set()).add(request_id)
        self.entries.move_to_end(content_hash)

    def allocate(self, request_id: str, content_hash: str, num_embeds: int) -> None:
        """Make an entry the runner fills this step (referenced by the request),
        evicting unreferenced entries, least recently used first."""
        assert content_hash not in self.entries, "allocate only what is not cached"
        for h in list(self.entries):
            if self.capacity - self.used >= num_embeds:
                break
            if not self.refs.get(h):
                self.used -= self.entries.pop(h)
                self.refs.pop(h, None)
                self._freed.append(h)
        assert self.capacity - self.used >= num_embeds, "caller checks room_for first"
        self.entries[content_hash] = num_embeds
        self.used += num_embeds
        self.num_encoded += 1
        self.add_ref(request_id, content_hash)

    def discard(self, content_hash: str) -> None:
        """Forget an entry allocated this step that nothing will encode after all."""
        self.used -= self.entries.pop(content_hash)
        self.refs.pop(content_hash, None)
        self.num_encoded -= 1

    def release(self, request_id: str, content_hash: str) -> None:
        holders = self.refs.get(content_hash)
        if holders is not None:
            holders.discard(request_id)

    def release_all(self, request_id: str, items: tuple[MultiModalItem, ...]) -> None:
        for item in items:
            self.release(request_id, item.content_hash)

    def take_freed(self) -> list[str]:
        """Hashes evicted since the last call (the runner drops their tensors)."""
        freed, self._freed = self._freed, []
        return freed


def encoder_cache_for(model, size: int | None, max_num_batched_tokens: int) -> EncoderCacheManager | None:
    """The encoder cache of a model that takes images (None for one that takes none):
    ``size`` embeddings, or the larger of 8192 and a step's token budget."""
    if not getattr(model, "supports_images", False):
        return None
    return EncoderCacheManager(size or max(8192, max_num_batched_tokens),
                               bool(getattr(model, "bidirectional_images", False)))
