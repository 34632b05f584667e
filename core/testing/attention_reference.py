"""The float64 reference the backend conformance check compares attention with: one
request's new queries over its whole context (causal, a sliding window, a logit cap,
bidirectional spans), and the random requests, block tables and caches it is fed."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

BLOCK_SIZE = 4
NUM_BLOCKS = 48
NUM_KV_HEADS = 2
NUM_HEADS = 2 * NUM_KV_HEADS
NUM_LAYERS = 2


@dataclass(frozen=True)
class RequestCase:
    """One request of a test batch; tensors are CPU float64 ground truth."""

    num_cached: int
    block_table: list[int]
    q: torch.Tensor  # (num_new, num_heads, head_dim)
    k: torch.Tensor  # (num_cached + num_new, num_kv_heads, head_dim)
    v: torch.Tensor
    block_size: int = BLOCK_SIZE

    @property
    def num_new(self) -> int:
        return self.q.shape[0]

    def slot(self, position: int) -> int:
        return self.block_table[position // self.block_size] * self.block_size + position % self.block_size


def block_tables(batch: tuple[tuple[int, int], ...], rng: random.Random, block_size: int) -> list[list[int]]:
    """Disjoint tables drawn from shuffled block ids; the second request's table is one
    block longer than its context needs (a backend must not touch that block)."""
    block_ids = list(range(NUM_BLOCKS))
    rng.shuffle(block_ids)
    tables = []
    for index, (num_cached, num_new) in enumerate(batch):
        num_table_blocks = -(-(num_cached + num_new) // block_size) + (1 if index == 1 else 0)
        table, block_ids = block_ids[:num_table_blocks], block_ids[num_table_blocks:]
        assert len(table) == num_table_blocks, "the test batch needs more than NUM_BLOCKS blocks"
        tables.append(table)
    return tables


def make_requests(
    batch: tuple[tuple[int, int], ...], tables: list[list[int]], head_dim: int, gen: torch.Generator,
    block_size: int = BLOCK_SIZE,
) -> list[RequestCase]:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return [
        RequestCase(
            num_cached=num_cached,
            block_table=table,
            q=randn(num_new, NUM_HEADS, head_dim),
            k=randn(num_cached + num_new, NUM_KV_HEADS, head_dim),
            v=randn(num_cached + num_new, NUM_KV_HEADS, head_dim),
            block_size=block_size,
        )
        for (num_cached, num_new), table in zip(batch, tables)
    ]


def reference_attention(request: RequestCase, scale: float, window: int | None = None,
                        softcap: float | None = None, spans: tuple = ()) -> torch.Tensor:
    """Dense causal attention of one request's new queries over its whole context (the
    last ``window`` positions up to each query's; scores capped ``softcap tanh(s / softcap)``;
    within each of ``spans`` both ways), in float64: ``(num_new, num_heads, head_dim)``."""
    group = NUM_HEADS // NUM_KV_HEADS
    k = request.k.repeat_interleave(group, dim=1).transpose(0, 1)  # (heads, context, D)
    v = request.v.repeat_interleave(group, dim=1).transpose(0, 1)
    q = request.q.transpose(0, 1)  # (heads, new, D)
    scores = q @ k.transpose(1, 2) * scale  # (heads, new, context)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    query_pos = torch.arange(request.num_cached, request.num_cached + request.num_new)[:, None]
    key_pos = torch.arange(request.k.shape[0])[None, :]
    hidden = key_pos > query_pos
    for start, end in spans:  # both ways within a span
        hidden &= ~((query_pos >= start) & (query_pos < end) & (key_pos >= start) & (key_pos < end))
    if window is not None:
        hidden |= key_pos <= query_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return (scores.softmax(dim=-1) @ v).transpose(0, 1)


def cache_with_context(
    requests: list[RequestCase], block_size: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """A random cache holding each request's cached context at its slots, as earlier
    steps would have written it."""
    cache = torch.randn(2, NUM_BLOCKS, block_size, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    flat = cache.view(2, NUM_BLOCKS * block_size, NUM_KV_HEADS, head_dim)
    for r in requests:
        slots = torch.tensor([r.slot(p) for p in range(r.num_cached)], dtype=torch.int64)
        flat[0, slots] = r.k[: r.num_cached].to(dtype)
        flat[1, slots] = r.v[: r.num_cached].to(dtype)
    return cache
