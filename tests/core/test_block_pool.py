"""BlockPool: ref counts, the free queue, the prefix-cache map and its lazy LRU eviction."""

import pytest

from tinypaged.core.block_pool import BlockPool, hash_block_tokens


def check(pool: BlockPool, refs: dict[int, int]) -> None:
    pool.check_integrity(refs)


def test_allocate_and_free_track_ref_counts() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    assert (a, b) == (0, 1) and pool.num_free_blocks == 2
    pool.incref(a)
    check(pool, {a: 2, b: 1})
    pool.free(a)
    pool.free(b)
    check(pool, {a: 1})
    pool.free(a)
    check(pool, {})
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a)


def test_out_of_blocks_raises() -> None:
    pool = BlockPool(1)
    pool.allocate()
    with pytest.raises(RuntimeError):
        pool.allocate()


def test_content_id_changes_on_every_allocation() -> None:
    pool = BlockPool(1)
    b = pool.allocate()
    first = pool.content_id(b)
    pool.free(b)
    assert pool.allocate() == b and pool.content_id(b) != first


def test_hit_needs_same_tokens_and_parent() -> None:
    pool = BlockPool(4, enable_caching=True)
    b = pool.allocate()
    h = hash_block_tokens(None, (1, 2))
    assert pool.cache_block(b, h, None, (1, 2)) == pool.content_id(b)
    assert pool.lookup(h, None, (1, 2)) == b
    assert pool.lookup(h, None, (1, 3)) is None  # same hash (forced), other tokens: a miss
    assert pool.lookup(h, 7, (1, 2)) is None  # same tokens after another parent: a miss
    assert pool.lookup(hash_block_tokens(None, (9, 9)), None, (9, 9)) is None


def test_colliding_hash_keeps_first_block_and_later_one_stays_private() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    key = b"same"
    pool.cache_block(a, key, None, (1, 2))
    # Another content under the same key: not registered, chains to its own content.
    assert pool.cache_block(b, key, None, (3, 4)) == pool.content_id(b)
    # Identical content computed twice: chains to the cached copy.
    assert pool.cache_block(c, key, None, (1, 2)) == pool.content_id(a)
    assert pool.lookup(key, None, (3, 4)) is None
    assert pool.num_cached_blocks == 1
    check(pool, {a: 1, b: 1, c: 1})


def test_freed_cached_block_is_reusable_until_evicted_lru() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = [pool.allocate() for _ in range(3)]
    for i, b in enumerate(blocks[:2]):
        pool.cache_block(b, bytes([i]), None, (i,))
    for b in blocks:
        pool.free(b)
    # Uncached free blocks go first; the cached ones stay findable.
    plain = pool.allocate()
    assert plain == blocks[2]
    assert pool.lookup(b"\x00", None, (0,)) == blocks[0]
    # A hit on a free cached block takes it out of the free queue.
    pool.incref(blocks[1])
    assert pool.num_free_blocks == 1
    check(pool, {plain: 1, blocks[1]: 1})
    # The next allocation evicts the least recently freed cached block.
    assert pool.allocate() == blocks[0]
    assert pool.lookup(b"\x00", None, (0,)) is None and pool.num_evictions == 1
    pool.free(blocks[1])
    check(pool, {plain: 1, blocks[0]: 1})
    assert pool.lookup(b"\x01", None, (1,)) == blocks[1]


def test_lru_order_follows_free_order() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = [pool.allocate() for _ in range(3)]
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]), None, (i,))
    for b in (blocks[2], blocks[0], blocks[1]):
        pool.free(b)
    assert [pool.allocate() for _ in range(3)] == [blocks[2], blocks[0], blocks[1]]
    assert pool.num_cached_blocks == 0


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(2)
    b = pool.allocate()
    pool.cache_block(b, b"k", None, (1,))
    assert pool.num_cached_blocks == 0 and pool.lookup(b"k", None, (1,)) is None


def test_check_integrity_catches_a_wrong_ref_count() -> None:
    pool = BlockPool(2)
    b = pool.allocate()
    with pytest.raises(AssertionError):
        pool.check_integrity({})
    with pytest.raises(AssertionError):
        pool.check_integrity({b: 2})
