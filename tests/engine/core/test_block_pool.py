import pytest

from pagedbatch.engine.core.block_pool import BlockPool, NoFreeBlocks, hash_block


def test_allocate_and_free_keep_counts():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1 and all(b.ref_count == 1 for b in blocks)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    pool.free(blocks)
    assert pool.num_free_blocks == 4


def test_freeing_twice_is_an_error():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError):
        pool.free([block])


def test_hash_is_chained_over_the_prefix():
    a = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == a
    assert hash_block(a, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])


def test_freed_cached_block_stays_findable_until_reused():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    h = hash_block(None, [1, 2, 3])
    pool.cache(block, h)
    pool.free([block])
    assert pool.lookup(h) is block  # free but still cached
    pool.touch([block])
    assert block.ref_count == 1 and pool.num_free_blocks == 1
    pool.free([block])
    pool.allocate(2)  # both blocks handed out: the cached one is evicted
    assert pool.lookup(h) is None


def test_eviction_is_least_recently_freed_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for block, tokens in ((a, [1]), (b, [2]), (c, [3])):
        pool.cache(block, hash_block(None, tokens))
    pool.free([b])
    pool.free([a])
    pool.free([c])
    (first,) = pool.allocate(1)
    assert first is b
    assert pool.lookup(hash_block(None, [1])) is a


def test_shared_block_is_freed_only_by_its_last_holder():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache(block, hash_block(None, [7]))
    pool.touch([block])
    pool.free([block])
    assert pool.num_free_blocks == 1
    pool.free([block])
    assert pool.num_free_blocks == 2


def test_caching_disabled_finds_nothing():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.allocate(1)
    h = hash_block(None, [1])
    pool.cache(block, h)
    assert pool.lookup(h) is None


def test_freed_blocks_are_reused_only_after_every_never_used_one():
    # blocks_ever_used is then the written part of the cache: blocks 0 .. n - 1.
    pool = BlockPool(6)
    first = pool.allocate(2)
    pool.free(first)
    assert pool.blocks_ever_used == 2
    assert [b.block_id for b in pool.allocate(4)] == [2, 3, 4, 5]
    assert pool.blocks_ever_used == 6
    assert {b.block_id for b in pool.allocate(2)} == {0, 1}
    assert pool.blocks_ever_used == 6
