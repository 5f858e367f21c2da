"""The KV block manager: allocation, reference counts, prefix reuse, eviction."""
from __future__ import annotations

from scheduler.block_manager import BlockManager


def test_allocate_grows_table_and_refuses_when_short():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate("a", 5) == [0, 1]
    assert bm.allocate("a", 8) == []  # still fits in two blocks
    assert bm.allocate("a", 9) == [2]
    assert bm.allocate("b", 8) is None  # needs 2, one free: nothing changes
    assert bm.num_free_blocks == 1
    bm.free_request("a")
    assert bm.num_free_blocks == 4 and bm.usage == 0.0


def test_cached_prefix_is_shared_with_reference_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    bm.allocate("a", len(prompt))
    bm.cache_full_blocks("a", prompt, len(prompt))
    cached = bm.find_cached_prefix(prompt[:8] + [99, 98])
    assert cached == bm.tables["a"][:2]
    bm.allocate("b", 10, cached)
    assert [bm.blocks[i].ref_count for i in cached] == [2, 2]
    bm.free_request("a")
    assert [bm.blocks[i].ref_count for i in cached] == [1, 1]


def test_prefix_lookup_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", prompt, 8)
    assert len(bm.find_cached_prefix(prompt)) == 1  # the last block would leave nothing to compute


def test_freed_cached_blocks_are_found_until_reused():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", [1, 2, 3, 4], 4)
    bm.free_request("a")
    assert len(bm.find_cached_prefix([1, 2, 3, 4, 5])) == 2
    bm.allocate("b", 6)  # takes every block: the cached ones are evicted
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == []


def test_hashes_chain_so_equal_blocks_after_different_prefixes_differ():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", [1, 2, 7, 7], 4)
    assert len(bm.find_cached_prefix([9, 9, 7, 7, 0])) == 0
    assert len(bm.find_cached_prefix([1, 2, 7, 7, 0])) == 2
