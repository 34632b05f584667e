"""Which images a step encodes, and where a prompt chunk must stop for them.

The scheduler asks once per request it schedules (`fit`, then `commit` when the
request's KV blocks are allocated): every image the chunk's tokens overlap must be
in the encoder cache or be encoded this step; the step encodes at most the step's
token budget of embeddings (more only for one image alone: progress is certain), and
the chunk stops before the first image that fits neither the budget nor the cache.
A chunk never starts inside an image it cannot read, so a prompt may compute its
text up to an image in one step and the image in a later one.
"""

from __future__ import annotations

from collections.abc import Callable

from ember.multimodal.inputs import embed_runs, overlapping
from ember.sched.encoder_cache import EncoderCacheManager
from ember.sched.request import Request


class EncoderPlanner:
    def __init__(self, cache: EncoderCacheManager, step_budget: int) -> None:
        self.cache = cache
        self.step_budget = step_budget  # embeddings one step may encode
        self.budget = step_budget  # what is left of it this step
        self.encode: dict[str, list[int]] = {}  # this step's images to encode: request id -> item indices

    def start_step(self) -> None:
        self.budget = self.step_budget
        self.encode = {}

    def check(self, request: Request) -> None:
        """ValueError if an image of the request could never be scheduled."""
        for item in request.mm_items:
            self.cache.check_fits(item)
            for run_start, run_end in embed_runs(item) if self.cache.whole_runs else ():
                if run_end - run_start > self.step_budget:
                    raise ValueError(f"an image's {run_end - run_start} tokens attend to each other and are computed "
                                     f"in one step, more than a step's {self.step_budget} tokens "
                                     "(raise --max-num-batched-tokens)")

    def fit(self, request: Request, start: int, num_new: int) -> tuple[int, list[int]]:
        """The tokens of ``[start, start + num_new)`` that can run this step and the
        request's images to encode for them (nothing is reserved until `commit`)."""
        if not request.mm_items or start >= request.num_prompt_tokens:
            return num_new, []
        if self.cache.whole_runs:  # never split a run of tokens that attend both ways
            num_new = self._whole_runs(request, start, num_new)
        items, cache, to_encode, planned = request.mm_items, self.cache, [], 0
        keep: set[str] = set()  # what the chunk reads up to here: never evicted for what it encodes
        for index in overlapping(items, start, start + num_new):
            item = items[index]
            if item.content_hash in keep:
                continue  # the same image again
            if item.content_hash in cache:
                if not cache.room_for(planned, keep | {item.content_hash}):
                    return max(0, item.offset - start), to_encode  # this step's encodes would evict it
                keep.add(item.content_hash)
                continue
            alone = self.budget == self.step_budget and not planned
            if (item.num_embeds > self.budget - planned and not alone) \
                    or not cache.room_for(planned + item.num_embeds, keep):
                return max(0, item.offset - start), to_encode
            to_encode.append(index)
            planned += item.num_embeds
            keep.add(item.content_hash)
        return num_new, to_encode

    @staticmethod
    def _whole_runs(request: Request, start: int, num_new: int) -> int:
        end = start + num_new
        for index in overlapping(request.mm_items, start, end):
            for run_start, run_end in embed_runs(request.mm_items[index]):
                if run_start < end < run_end:  # the chunk would end inside this run: stop before it
                    return max(0, run_start - start)
        return num_new

    def fit_chunk(self, request: Request, start: int, num_new: int, cost: int,
                  rechunk: Callable[[int], tuple[int, int]]) -> tuple[int, int, list[int]]:
        """`fit`, with the chunk's cost taken again (``rechunk(num)``) when it was cut."""
        cut, to_encode = self.fit(request, start, num_new)
        if cut < num_new:
            num_new, cost = rechunk(cut) if cut else (0, 0)
        return num_new, cost, to_encode

    def commit(self, request: Request, start: int, num_new: int, to_encode: list[int]) -> None:
        """Reference the images this step's tokens read (first: an allocation never evicts
        them), then allocate those it encodes."""
        cache, items = self.cache, request.mm_items
        indices = overlapping(items, start, start + num_new)
        for index in indices:
            content_hash = items[index].content_hash
            if index not in to_encode and content_hash in cache:
                if request.request_id not in cache.refs.get(content_hash, ()):
                    cache.num_hits += 1
                cache.add_ref(request.request_id, content_hash)
        for index in to_encode:
            cache.allocate(request.request_id, items[index].content_hash, items[index].num_embeds)
            self.budget -= items[index].num_embeds
        if to_encode:
            self.encode[request.request_id] = to_encode

    def computed(self, request: Request, start: int) -> None:
        """After a step: release the images whose runs the request has now computed (an
        image it shows again later is found in the cache then, or encoded again: holding it
        could leave no room for the images between)."""
        for item in request.mm_items:
            if start < item.end <= request.num_computed_tokens:
                self.cache.release(request.request_id, item.content_hash)

    def drop(self, request: Request, scheduled: dict[str, int] | None, requests: dict[str, Request]) -> None:
        """Release a request that finished or was preempted. One preempted in the step
        that planned to encode some of its images hands each to another request of the
        step that reads it, else un-allocates it."""
        cache = self.cache
        for index in self.encode.pop(request.request_id, ()) if scheduled is not None else ():
            content_hash = request.mm_items[index].content_hash
            other = next((o for o in cache.refs.get(content_hash, ()) if o != request.request_id and o in scheduled),
                         None)
            if other is None:
                cache.discard(content_hash)
                continue
            items = requests[other].mm_items
            self.encode.setdefault(other, []).append(
                next(j for j, item in enumerate(items) if item.content_hash == content_hash))
        cache.release_all(request.request_id, request.mm_items)
