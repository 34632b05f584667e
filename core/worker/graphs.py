"""Decode steps replayed from device graphs (CUDA graphs, HPU graphs): the model's
forward pass for a batch of ``size`` decoding requests is captured once per size at
start-up and replayed per step, so a decode step costs one graph launch instead of
hundreds of kernel launches from Python.

A graph replays fixed kernels on fixed memory, so everything a captured forward reads
lives in static tensors that each step overwrites in place: the input ids, the
positions and the attention's metadata (the attention builds and refills it:
``BaseAttention.graph_metadata`` / ``fill_graph_metadata``). A step of ``n``
decodes replays the graph of the smallest captured size ``>= n``; rows ``n ..
size`` are padding, whose cache slot is -1 (nothing written) and whose outputs are
dropped. Steps with prompt tokens, draft tokens or more decodes than the largest
size run eagerly.

The backend supplies the capture (``BaseBackend.graph_capture``): a callable that
turns ``fn`` (a forward over the static tensors) into ``replay() -> output``, or
raises `ember.plugin.backend.GraphCaptureRefused` when its graphs cannot hold that forward (the
CPU's, for one, hold only its native kernels): that size then runs eagerly. Core
never names a device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from ember.plugin.backend import AttentionBatch, BaseAttention, GraphCaptureRefused

logger = logging.getLogger(__name__)


def default_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes captured when the user names none: 1, 2, 4, 8, then every 16
    up to ``max_num_seqs`` (at most 256), and ``max_num_seqs`` itself if below 256."""
    limit = min(max_num_seqs, 256)
    sizes = {s for s in (1, 2, 4, 8) if s <= limit} | set(range(16, limit + 1, 16)) | {limit}
    return tuple(sorted(sizes))


class DecodeGraphs:
    """Captured forward passes of decode-only batches, by batch size."""

    def __init__(
        self,
        model,
        attention: BaseAttention,
        kv_caches: list[torch.Tensor],
        capture: Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]],
        sizes: Sequence[int],
        max_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"graph batch sizes must be positive integers, got {list(sizes)}")
        sizes = tuple(sorted(set(sizes)))
        self.attention = attention
        largest = sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[Callable[[], torch.Tensor], object]] = {}
        refused: dict[str, list[int]] = {}  # why -> sizes
        started = time.perf_counter()
        for size in reversed(sizes):  # the largest first: the smaller ones reuse its memory
            metadata = attention.graph_metadata(size, max_blocks, block_size, device)
            ids, positions = self.input_ids[:size], self.positions[:size]

            def forward(ids=ids, positions=positions, metadata=metadata) -> torch.Tensor:
                return model(ids, positions, kv_caches, metadata)

            try:
                self.graphs[size] = (capture(forward), metadata)
            except GraphCaptureRefused as exc:
                refused.setdefault(str(exc), []).append(size)
        self.sizes = tuple(sorted(self.graphs))
        self.capture_seconds = time.perf_counter() - started
        for why, sizes_refused in refused.items():
            logger.info("decode graphs of batch sizes %s refused (they run eagerly): %s",
                        ",".join(map(str, sorted(sizes_refused))), why)
        if self.sizes:
            logger.info(
                "captured %d decode graphs (batch sizes %s) in %.2f s", len(self.sizes),
                ",".join(map(str, self.sizes)), self.capture_seconds,
            )

    @property
    def is_empty(self) -> bool:
        """Whether no size was captured (every one refused)."""
        return not self.sizes

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, num_requests: int) -> int | None:
        """The captured size a step of ``num_requests`` decodes replays, or None."""
        for size in self.sizes:
            if size >= num_requests:
                return size
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Hidden states ``(n, hidden)`` of a decode-only step of ``n`` requests (one
        token each): the step's inputs copied into the static tensors, then a replay."""
        n = input_ids.shape[0]
        size = self.size_for(n)
        if size is None:
            raise ValueError(f"a step of {n} decodes exceeds the largest captured graph ({self.max_size})")
        replay, metadata = self.graphs[size]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        if size > n:  # padding rows: token 0 at position 0, nothing written (slot -1)
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
        self.attention.fill_graph_metadata(metadata, batch)
        return replay()[:n]


def capture_decode_graphs(runner, backend, attention: BaseAttention, config) -> float | None:
    """Capture ``runner``'s decode steps in device graphs where the backend has them and
    the attention has a static form (``config``: ``enforce_eager``, ``graph_sizes``,
    ``max_num_seqs``); the seconds it took, or None."""
    if config.enforce_eager or config.graph_sizes == ():
        return None
    capture = backend.graph_capture()
    if capture is None:
        return None
    if not attention.supports_graphs:
        logger.info("device graphs: off (the %s attention has no static form); decode steps run eagerly",
                    attention.name)
        return None
    sizes = config.graph_sizes or [
        s for s in backend.graph_batch_sizes or default_graph_sizes(config.max_num_seqs) if s <= config.max_num_seqs
    ]
    return runner.capture_graphs(capture, sizes).capture_seconds
