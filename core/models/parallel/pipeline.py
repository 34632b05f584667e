"""Micro-batches for pipeline parallelism.

A step's flat batch is split at request boundaries into up to ``num_micro_batches``
groups of about equal token counts, each with its own attention metadata, so that
pipeline stages work on different micro-batches at once
(``ember.models.parallel.model.pipeline_forward``). :class:`MicroBatchAttention` wraps the
backend's attention for the model runner: ``prepare`` returns the micro-batches;
the layers themselves call the wrapped attention with one micro-batch's metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.plugin.backend import AttentionBatch, BaseAttention


@dataclass(slots=True)
class MicroBatches:
    """``parts[i] = (first flat token, end, attention metadata)``, in flat order."""

    parts: list[tuple[int, int, Any]]


def split_requests(query_lens: list[int], num_parts: int) -> list[tuple[int, int]]:
    """Request ranges ``[a, b)`` covering ``query_lens`` in order, at most ``num_parts``
    of them, each ending at the first request past its share of the tokens."""
    num_parts = max(1, min(num_parts, len(query_lens)))
    total = sum(query_lens)
    ranges, start, done = [], 0, 0
    for part in range(1, num_parts + 1):
        if start >= len(query_lens):
            break
        target = total * part / num_parts
        end = start + 1
        done += query_lens[start]
        # leave at least one request for each remaining part
        while end < len(query_lens) - (num_parts - part) and done + query_lens[end] <= target:
            done += query_lens[end]
            end += 1
        if part == num_parts:
            done += sum(query_lens[end:])
            end = len(query_lens)
        ranges.append((start, end))
        start = end
    return ranges


def slice_batch(batch: AttentionBatch, start: int, end: int) -> AttentionBatch:
    """Requests ``[start, end)`` of ``batch`` as a batch of their own."""
    loc = batch.query_start_loc
    first, last = int(loc[start]), int(loc[end])
    return AttentionBatch(
        batch.query_lens[start:end], batch.start_positions[start:end], batch.block_table[start:end],
        batch.slot_mapping[first:last], batch.block_size, batch.seq_lens[start:end], loc[start : end + 1] - first,
    )


class MicroBatchAttention(BaseAttention):
    """The runner's view of ``inner`` on a pipeline stage: ``prepare`` makes micro-batches."""

    supports_graphs = False

    def __init__(self, inner: BaseAttention, num_micro_batches: int) -> None:
        self.inner = inner
        self.num_micro_batches = num_micro_batches
        self.name = inner.name
        self.default_block_size = inner.default_block_size
        self.block_size_multiple = inner.block_size_multiple

    def prepare(self, batch: AttentionBatch) -> MicroBatches:
        loc = batch.query_start_loc.tolist()
        parts = []
        for start, end in split_requests(batch.query_lens, self.num_micro_batches):
            sub = batch if (start, end) == (0, batch.num_requests) else slice_batch(batch, start, end)
            parts.append((loc[start], loc[end], self.inner.prepare(sub)))
        return MicroBatches(parts)

    def forward(self, q, k, v, kv_cache, metadata, scale):  # pragma: no cover - layers call the inner one
        raise RuntimeError("MicroBatchAttention only prepares micro-batches; the layers use the wrapped attention")
