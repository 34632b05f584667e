"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and per-request block tables.

This module holds no tensors. The cache itself is a per-layer tensor of shape
`(2, num_blocks, block_size, num_kv_heads, head_dim)` owned by the model runner;
a token at position `p` of a request lives in slot
`block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from collections import deque


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Free list of block ids `0 .. num_blocks - 1`. Freed blocks go to the back."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, num: int) -> list[int]:
        assert 0 <= num <= len(self._free), "caller must check num_free_blocks first"
        return [self._free.popleft() for _ in range(num)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


class KVCacheManager:
    """Owns the block tables of running requests.

    Invariant: every block id is either in the pool's free list or in exactly
    one request's block table; after all requests are freed the pool is full.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that `request_id` can hold `num_tokens` tokens in total."""
        owned = len(self._block_tables.get(request_id, ()))
        return max(0, self.num_blocks_for(num_tokens) - owned)

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens in total.

        Returns the newly added block ids, or None (and changes nothing) if the
        pool has too few free blocks.
        """
        num_new = self.num_new_blocks_needed(request_id, num_tokens)
        if num_new > self.pool.num_free_blocks:
            return None
        new_blocks = self.pool.allocate(num_new)
        self._block_tables.setdefault(request_id, []).extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool; unknown ids are a no-op."""
        blocks = self._block_tables.pop(request_id, None)
        if blocks:
            self.pool.free(blocks)

    def get_block_table(self, request_id: str) -> list[int]:
        return self._block_tables.get(request_id, [])

    def num_allocated_blocks(self, request_id: str) -> int:
        return len(self._block_tables.get(request_id, ()))
