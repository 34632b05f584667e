import pytest

from ember.kv_cache_manager import BlockPool, KVCacheManager


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


def test_free_returns_blocks_and_they_are_reused_in_fifo_order():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", 4)  # 0, 1
    kv.allocate_slots("b", 2)  # 2
    kv.free("a")
    assert kv.num_free_blocks == 3
    assert kv.allocate_slots("c", 6) == [3, 0, 1]
    kv.free("b"), kv.free("c"), kv.free("unknown")
    assert kv.num_free_blocks == 4


def test_num_new_blocks_needed():
    kv = KVCacheManager(num_blocks=10, block_size=16)
    assert kv.num_new_blocks_needed("x", 1) == 1
    assert kv.num_new_blocks_needed("x", 16) == 1
    assert kv.num_new_blocks_needed("x", 17) == 2
    kv.allocate_slots("x", 16)
    assert kv.num_new_blocks_needed("x", 17) == 1


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_sizes_are_rejected(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, bad)
