import pytest

from ember.sched.kv_cache_manager import BlockPool, KVCacheManager


def test_allocate_grows_table_block_by_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 5) == [0, 1]
    assert kv.get_block_table("a") == [0, 1]
    assert kv.allocate_slots("a", 8) == []  # still fits in two blocks
    assert kv.allocate_slots("a", 9) == [2]
    assert kv.allocate_slots("b", 1) == [3]
    assert kv.num_free_blocks == 4


def test_allocate_fails_without_partial_allocation():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate_slots("a", 8) == [0, 1]
    assert kv.allocate_slots("b", 9) is None
    assert kv.get_block_table("b") == []
    assert kv.num_free_blocks == 1


def test_free_returns_blocks_tail_first_and_they_are_reused_in_fifo_order():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", 4)  # 0, 1
    kv.allocate_slots("b", 2)  # 2
    kv.free("a")
    assert kv.num_free_blocks == 3
    # never-used 3 first, then a's blocks tail first (its prefix stays cached longest)
    assert kv.allocate_slots("c", 6) == [3, 1, 0]
    kv.free("b"), kv.free("c"), kv.free("unknown")
    assert kv.num_free_blocks == 4


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_sizes_are_rejected(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, bad)


# -- prefix caching ---------------------------------------------------------------------

def test_full_blocks_are_found_by_chained_digest_and_shared_by_reference():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    assert kv.find_cached_prefix(prompt) == []
    kv.allocate_slots("a", len(prompt))
    kv.cache_full_blocks("a", prompt, num_computed_tokens=11)
    a_table = kv.get_block_table("a")
    assert kv.find_cached_prefix(prompt) == a_table[:2]
    # same first block, different second block: only the first is shared
    other = prompt[:4] + [1, 2, 3, 4, 5]
    assert kv.find_cached_prefix(other) == a_table[:1]
    # a prefix that is a whole prompt: the last token is never covered
    assert kv.find_cached_prefix(prompt[:8]) == a_table[:1]
    assert kv.find_cached_prefix(prompt[:9]) == a_table[:2]
    hit = kv.find_cached_prefix(prompt)
    free_before = kv.num_free_blocks
    new = kv.allocate_slots("b", len(prompt), cached_blocks=hit)
    assert kv.get_block_table("b") == a_table[:2] + new and len(new) == 1
    assert kv.num_free_blocks == free_before - 1  # shared blocks cost nothing
    assert kv.pool.blocks[a_table[0]].ref_count == 2


def test_freed_prefix_stays_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    p = [1, 2, 3, 4, 5]
    kv.allocate_slots("a", 5)
    kv.cache_full_blocks("a", p, 5)
    table = kv.get_block_table("a")
    kv.free("a")
    assert kv.num_free_blocks == 4
    assert kv.find_cached_prefix(p) == table[:2]
    # taking a cached free block costs a free block
    assert kv.count_free_among(table[:2]) == 2
    kv.allocate_slots("b", 5, cached_blocks=table[:2])
    assert kv.num_free_blocks == 1
    kv.free("b")
    # a request needing the whole pool evicts every cached block
    kv.allocate_slots("c", 8)
    assert kv.find_cached_prefix(p) == [] and kv.pool.cached == {}
    kv.free("c")
    assert kv.num_free_blocks == 4


def test_allocation_with_hits_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    p = [7, 8, 9, 10, 11]
    kv.allocate_slots("a", 5)
    kv.cache_full_blocks("a", p, 5)
    kv.free("a")
    hit = kv.find_cached_prefix(p)
    assert len(hit) == 2
    assert kv.allocate_slots("b", 9, cached_blocks=hit) is None  # needs 5 blocks
    assert kv.num_free_blocks == 3 and kv.get_block_table("b") == []
    assert all(kv.pool.blocks[b].ref_count == 0 for b in hit)


def test_prefix_caching_off_finds_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", 4)
    kv.cache_full_blocks("a", [1, 2, 3, 4], 4)
    assert kv.find_cached_prefix([1, 2, 3, 4, 5]) == []
