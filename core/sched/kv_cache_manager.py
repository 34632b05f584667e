"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, per-request block
tables, and automatic prefix caching.

This module holds no tensors. The cache itself is a per-layer tensor of shape
`(2, num_blocks, block_size, num_kv_heads, head_dim)` owned by the model runner;
a token at position `p` of a request lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

Prefix caching: a *full* block is identified by a digest chained from its parent
block's digest and its own token ids, so equal digests mean equal prefixes. A new
request reuses every cached block of its prompt by reference count. A block whose
last user leaves keeps its contents and digest and goes to the back of the free
queue; it is evicted (forgets its digest) only when the pool hands it out again,
least recently freed first.

Sliding windows: for a model whose every layer attends over a window of ``W`` keys
(``sliding_window``), a block whose tokens lie wholly before ``num_computed - W + 1``
is never read again (attention reads from the window's first block on), so
`release_out_of_window` drops the request's reference to it: the pool can hand it out
while the request runs (a 32k-token request of Mistral-7B-v0.1 holds about ``W`` tokens of
blocks, not 32k). Its id stays in the request's table (kept valid: attention never reads
it) and is never freed twice. Models mixing sliding and global layers keep every block.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_digest(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """sha256 over the parent's digest, the block's token ids and ``extra`` (what else
    decides its K/V: the content hashes of the images it overlaps; collisions negligible)."""
    h = hashlib.sha256(parent or b"\0" * 32)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra:
        h.update(extra)
    return h.digest()


def block_extras(mm_items: Sequence, num_blocks: int, block_size: int) -> list[bytes]:
    """Per block, the content hashes of the images whose runs overlap it (b"" for none):
    an image's placeholder tokens are the same for every image, so its hash goes into
    the digest of every block it touches (and, through the chain, of every later block)."""
    extras = [b""] * num_blocks
    for item in mm_items:
        first, last = item.offset // block_size, min(num_blocks, -(-item.end // block_size))
        for i in range(first, last):
            extras[i] += item.content_hash.encode()
    return extras


def adapter_root(adapter_id: int) -> bytes | None:
    """The digest a chain of blocks computed under an adapter starts from (None: the
    base model's chains): no block computed under one adapter serves another, or the base."""
    if not adapter_id:
        return None
    return hashlib.sha256(b"ember-adapter:" + struct.pack("<q", adapter_id)).digest()


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    digest: bytes | None = None  # set once the block is full and registered


class BlockPool:
    """Blocks `0 .. num_blocks - 1` with reference counts.

    Invariant: a block is in the free queue iff its ref_count is 0. Free blocks
    may still hold a cached prefix (their digest is in `cached`) until handed out.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, num: int) -> list[int]:
        """Hand out `num` free blocks (evicting any prefix they cached)."""
        assert 0 <= num <= len(self._free), "caller must check num_free_blocks first"
        out = []
        for _ in range(num):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.digest is not None:
                if self.cached.get(block.digest) == block_id:
                    del self.cached[block.digest]
                block.digest = None
            block.ref_count = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on cached blocks (a prefix-cache hit)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference each; blocks that reach 0 join the back of the free queue.
        Pass a request's blocks tail first, so its last blocks are evicted first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def register(self, block_id: int, digest: bytes) -> None:
        """Record that a full block holds the prefix `digest` (first writer wins)."""
        block = self.blocks[block_id]
        if block.digest is None and digest not in self.cached:
            block.digest = digest
            self.cached[digest] = block_id


class KVCacheManager:
    """Owns the block tables of running requests.

    Invariant: every block id is in the pool's free queue (ref_count 0) or in the
    live part of the tables (past their released blocks) of exactly `ref_count`
    requests; after all requests are freed the pool is full again (cached prefixes
    stay findable until evicted).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 sliding_window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # every layer's window: out-of-window blocks are released
        self._released: dict[str, int] = {}  # leading blocks of each table whose reference was dropped
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}
        self._digests: dict[str, list[bytes]] = {}  # digests of each request's full blocks
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # prompt tokens found cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- prefix caching ---------------------------------------------------------
    def find_cached_prefix(self, prompt_token_ids: Sequence[int], adapter_id: int = 0,
                           mm_items: Sequence = ()) -> list[int]:
        """Block ids caching the longest prefix of the prompt (computed under the same
        adapter, with the same images), in order. The last prompt token is never
        covered: its logits are needed, so it is recomputed."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        found: list[int] = []
        parent: bytes | None = adapter_root(adapter_id)
        num = (len(prompt_token_ids) - 1) // bs
        extras = block_extras(mm_items, num, bs) if mm_items else None
        for i in range(num):
            parent = block_digest(parent, prompt_token_ids[i * bs : (i + 1) * bs], extras[i] if extras else b"")
            block_id = self.pool.cached.get(parent)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def count_free_among(self, block_ids: Sequence[int]) -> int:
        """How many of these cached blocks sit in the free queue (taking them costs a free block)."""
        return sum(1 for b in block_ids if self.pool.blocks[b].ref_count == 0)

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_queries += num_prompt_tokens
        self.num_prefix_hits += num_hit_tokens

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

    def has_uncached_full_blocks(self, request_id: str, num_computed_tokens: int) -> bool:
        """Whether a block of the request filled up since the last `cache_full_blocks`
        (true once per `block_size` decode steps): callers skip building token lists otherwise."""
        if not self.enable_prefix_caching:
            return False
        num_full = min(num_computed_tokens // self.block_size, len(self._block_tables.get(request_id, ())))
        return len(self._digests.get(request_id, ())) < num_full

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          adapter_id: int = 0, mm_items: Sequence = ()) -> None:
        """Register the request's blocks that became full of computed tokens (under
        ``adapter_id``, with ``mm_items``' images)."""
        if not self.enable_prefix_caching:
            return
        table = self._block_tables.get(request_id, [])
        digests = self._digests.setdefault(request_id, [])
        bs = self.block_size
        num = min(num_computed_tokens // bs, len(table))
        extras = block_extras(mm_items, num, bs) if mm_items and len(digests) < num else None
        while len(digests) < num:
            i = len(digests)
            parent = digests[-1] if digests else adapter_root(adapter_id)
            digest = block_digest(parent, token_ids[i * bs : (i + 1) * bs], extras[i] if extras else b"")
            digests.append(digest)
            self.pool.register(table[i], digest)

    # -- allocation -----------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens in total, first with
        `cached_blocks` (a prefix hit, only for a request that owns no block yet).

        Returns the newly allocated block ids, or None (and changes nothing) if the
        pool has too few free blocks.
        """
        table = self._block_tables.get(request_id)
        if table is not None and not cached_blocks and len(table) * self.block_size >= num_tokens:
            return []  # the common decode step: its slot lies in a block it holds
        assert not (cached_blocks and table), "cached blocks only start a table"
        num_new = max(0, self.num_blocks_for(num_tokens) - len(cached_blocks) - len(table or ()))
        if num_new + self.count_free_among(cached_blocks) > self.pool.num_free_blocks:
            return None
        if table is None:
            table = self._block_tables[request_id] = []
        if cached_blocks:
            self.pool.touch(cached_blocks)
            table.extend(cached_blocks)
            digests = self._digests.setdefault(request_id, [])
            digests.extend(self.pool.blocks[b].digest for b in cached_blocks)
        new_blocks = self.pool.allocate(num_new)
        table.extend(new_blocks)
        return new_blocks

    def release_out_of_window(self, request_id: str, num_computed_tokens: int) -> int:
        """With ``sliding_window``: drop the request's references to its leading blocks that
        no later query reaches (every position ``<= num_computed_tokens - window``), once
        each; return how many were released now. Call after `cache_full_blocks` (a released
        block keeps its cached prefix until the pool hands it out) with a count that later
        steps never go below (accepted tokens, not drafts that may be rejected)."""
        window = self.sliding_window
        table = self._block_tables.get(request_id)
        if window is None or not table:
            return 0
        done = self._released.get(request_id, 0)
        dead = min(len(table), max(0, num_computed_tokens - window + 1) // self.block_size)
        if dead <= done:
            return 0
        self.pool.free(table[done:dead][::-1])
        self._released[request_id] = dead
        return dead - done

    def num_released_blocks(self, request_id: str) -> int:
        return self._released.get(request_id, 0)

    def free(self, request_id: str) -> None:
        """Drop the request's references (tail first, released blocks skipped); unknown ids are a no-op."""
        blocks = self._block_tables.pop(request_id, None)
        self._digests.pop(request_id, None)
        done = self._released.pop(request_id, 0)
        if blocks:
            self.pool.free(blocks[done:][::-1])

    def get_block_table(self, request_id: str) -> list[int]:
        return self._block_tables.get(request_id, [])

    def num_allocated_blocks(self, request_id: str) -> int:
        return len(self._block_tables.get(request_id, ()))
