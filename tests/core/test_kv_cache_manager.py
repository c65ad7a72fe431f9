"""KVCacheManager: block tables, copy-on-write, fork, free, swap, prefix caching, watermark, integrity."""

import pytest

from tinypaged.core.block_pool import BlockHash, hash_block_tokens
from tinypaged.core.kv_cache_manager import KVCacheManager
from tinypaged.core.sequence import Sequence, SequenceGroup

from .shadow import ShadowCache, check_snapshot, manager_state


def make(num_gpu: int = 8, num_cpu: int = 8, bs: int = 4, **kw: object) -> KVCacheManager:
    return KVCacheManager(bs, num_gpu, num_cpu, watermark=0.0, **kw)  # type: ignore[arg-type]


def compute(kv: KVCacheManager, shadow: ShadowCache, seq: Sequence, n: int) -> list[tuple[int, int]]:
    """What one scheduled step does to a sequence: allocate, copy, write, advance, cache."""
    copies = kv.allocate_slots(seq, n)
    assert copies is not None
    shadow.copy(copies)
    shadow.write(kv.get_block_table(seq.seq_id), seq.token_ids, seq.num_computed_tokens, n)
    seq.num_computed_tokens += n
    kv.cache_block(seq)
    return copies


def admit(kv: KVCacheManager, seq: Sequence) -> int:
    """What admission does to a new sequence: look up its cached prefix, take it; returns the tokens it covers."""
    hit = kv.lookup_prefix(seq)
    kv.take_prefix(seq, hit)
    seq.num_computed_tokens = hit.num_tokens
    return hit.num_tokens


def test_allocate_slots_covers_positions_and_none_changes_nothing() -> None:
    kv = make(num_gpu=3)
    seq = Sequence(0, list(range(6)))
    assert kv.allocate_slots(seq, 6) == []
    assert len(kv.get_block_table(0)) == 2
    seq.num_computed_tokens = 6
    assert kv.allocate_slots(seq, 2) == [] and len(kv.get_block_table(0)) == 2  # fits the partial block
    other = Sequence(1, list(range(9)))
    assert kv.allocate_slots(other, 9) is None
    assert kv.get_block_table(1) == [] and kv.num_free_gpu_blocks == 1
    kv.check_integrity()
    kv.free(0)
    kv.free(1)
    assert kv.num_free_gpu_blocks == 3 and kv.gpu_usage == 0.0


def test_fork_shares_blocks_and_copy_on_write_gives_the_writer_the_copy() -> None:
    kv = make()
    shadow = ShadowCache(4)
    parent = Sequence(0, [1, 2, 3, 4, 5, 6])
    compute(kv, shadow, parent, 6)
    child = parent.fork(1)
    kv.fork(0, 1)
    assert kv.get_block_table(1) == kv.get_block_table(0)
    assert kv.gpu_pool.ref_count(kv.get_block_table(0)[1]) == 2
    kv.check_integrity()
    shared_last = kv.get_block_table(0)[1]
    child.append_token(7)
    copies = compute(kv, shadow, child, 1)
    # The child wrote into the shared partial block: it gets a fresh copy, the parent keeps the original.
    assert len(copies) == 1 and copies[0][0] == shared_last
    assert kv.get_block_table(0)[1] == shared_last
    assert kv.get_block_table(1)[1] == copies[0][1]
    assert kv.get_block_table(1)[0] == kv.get_block_table(0)[0]  # the full block stays shared
    parent.append_token(8)
    assert compute(kv, shadow, parent, 1) == []  # now the only holder: writes in place
    shadow.check_seq(kv, parent)
    shadow.check_seq(kv, child)
    kv.check_integrity()
    kv.free(0)
    kv.free(1)
    assert kv.num_free_gpu_blocks == 8


def test_copy_on_write_counts_siblings_exactly() -> None:
    kv = make(num_gpu=4)
    seqs = [Sequence(0, [1, 2, 3, 4, 5])]
    compute(kv, ShadowCache(4), seqs[0], 5)
    for i in (1, 2):
        seqs.append(seqs[0].fork(i))
        kv.fork(0, i)
    items = [(s, 1) for s in seqs]
    for s in seqs:
        s.append_token(9)
    # Three holders of the partial block: the first two writers copy, the last writes in place.
    assert kv.blocks_needed(items) == 2
    copies = kv.allocate_group_slots(items)
    assert copies is not None and len(copies) == 2
    kv.check_integrity()


def test_group_allocation_is_all_or_nothing() -> None:
    kv = make(num_gpu=3)
    a, b = Sequence(0, [1] * 8), Sequence(1, [2] * 8)
    assert kv.allocate_group_slots([(a, 8), (b, 8)]) is None
    assert kv.num_free_gpu_blocks == 3 and kv.get_block_table(0) == []
    kv.check_integrity()


def test_swap_out_and_in_keeps_sharing_and_copies_each_block_once() -> None:
    kv = make(num_gpu=6, num_cpu=4)
    shadow = ShadowCache(4)
    parent = Sequence(0, list(range(10)))
    compute(kv, shadow, parent, 10)
    child = parent.fork(1)
    kv.fork(0, 1)
    group = SequenceGroup("r", [parent, child], 0.0)
    assert kv.can_swap_out(group)
    out = kv.swap_out(group)
    shadow.swap_out(out)
    assert len(out) == 3 and len({g for g, _ in out}) == 3 and len({c for _, c in out}) == 3
    assert kv.is_swapped(0) and kv.is_swapped(1)
    assert kv.get_block_table(0) == kv.get_block_table(1)
    assert kv.num_free_gpu_blocks == 6 and kv.num_free_cpu_blocks == 1
    kv.check_integrity()
    shadow.check_seq(kv, child)
    assert kv.can_swap_in(group)
    back = kv.swap_in(group)
    shadow.swap_in(back)
    assert len(back) == 3 and kv.num_free_cpu_blocks == 4
    assert kv.get_block_table(0) == kv.get_block_table(1)
    for s in (parent, child):
        shadow.check_seq(kv, s)
    kv.check_integrity()


def test_snapshot_names_holders_and_ref_counts_through_fork_cow_prefix_hit_and_swap() -> None:
    kv = make(num_gpu=8, num_cpu=8, enable_prefix_caching=True)
    shadow = ShadowCache(4)
    owners = {0: "a", 1: "a", 2: "b"}
    a = Sequence(0, [1, 2, 3, 4, 5, 6])
    compute(kv, shadow, a, 6)
    full, partial = kv.get_block_table(0)
    before = manager_state(kv, owners)
    snap = kv.snapshot(owners)
    assert manager_state(kv, owners) == before, "a snapshot only reads"
    check_snapshot(kv, snap, owners)
    assert snap.gpu.holders == {full: ("a",), partial: ("a",)} and snap.gpu.cached == {full}
    assert snap.gpu.ref_counts[full] == snap.gpu.ref_counts[partial] == 1

    child = a.fork(1)  # n = 2: the sample shares every block, one request holds them twice
    kv.fork(0, 1)
    snap = kv.snapshot(owners)
    assert snap.gpu.holders == {full: ("a",), partial: ("a",)}
    assert snap.gpu.ref_counts[full] == snap.gpu.ref_counts[partial] == 2
    child.append_token(9)
    (src, copy), *_ = compute(kv, shadow, child, 1)  # copy-on-write of the shared partial block
    snap = kv.snapshot(owners)
    check_snapshot(kv, snap, owners)
    assert src == partial and snap.gpu.ref_counts[partial] == 1 and snap.gpu.ref_counts[copy] == 1
    assert snap.gpu.holders[copy] == ("a",) and snap.gpu.ref_counts[full] == 2

    b = Sequence(2, [1, 2, 3, 4, 7, 7])  # another request whose prompt starts with the cached block
    assert admit(kv, b) == 4
    compute(kv, shadow, b, 2)
    snap = kv.snapshot(owners)
    check_snapshot(kv, snap, owners)
    assert snap.gpu.holders[full] == ("a", "b") and snap.gpu.ref_counts[full] == 3

    out = kv.swap_out(SequenceGroup("a", [a, child], 0.0))
    snap = kv.snapshot(owners)
    check_snapshot(kv, snap, owners)
    assert snap.gpu.holders[full] == ("b",) and snap.gpu.ref_counts[full] == 1 and full in snap.gpu.cached
    assert sorted(snap.cpu.holders) == sorted(c for _, c in out) and len(out) == 3
    assert set(snap.cpu.holders.values()) == {("a",)} and sorted(snap.cpu.ref_counts, reverse=True)[:3] == [
        2,
        1,
        1,
    ]
    assert not snap.cpu.cached

    for seq_id in owners:
        kv.free(seq_id)
    snap = kv.snapshot(owners)
    check_snapshot(kv, snap, owners)
    assert not snap.gpu.holders and not snap.cpu.holders and set(snap.gpu.ref_counts) == {0}
    assert full in snap.gpu.cached  # free, its content kept until evicted


def test_swap_needs_room() -> None:
    kv = make(num_gpu=4, num_cpu=1)
    seq = Sequence(0, list(range(8)))
    kv.allocate_slots(seq, 8)
    group = SequenceGroup("r", [seq], 0.0)
    assert not kv.can_swap_out(group)
    with pytest.raises(RuntimeError):
        kv.swap_out(group)


def test_prefix_hit_shares_full_blocks_but_never_the_last_token() -> None:
    kv = make(enable_prefix_caching=True)
    shadow = ShadowCache(4)
    first = Sequence(0, list(range(8)))
    assert admit(kv, first) == 0
    compute(kv, shadow, first, 8)
    # Same 8-token prompt: only the first block is shared; the last block is recomputed for logits.
    same = Sequence(1, list(range(8)))
    assert admit(kv, same) == 4
    assert kv.get_block_table(1) == kv.get_block_table(0)[:1]
    longer = Sequence(2, list(range(9)))
    assert admit(kv, longer) == 8
    other = Sequence(3, [0, 1, 2, 99, 4])
    assert admit(kv, other) == 0
    assert kv.num_prefix_hit_blocks == 3
    for s in (same, longer):
        shadow.check_seq(kv, s)
    kv.check_integrity()


def test_freed_prefix_stays_cached_until_evicted() -> None:
    kv = make(num_gpu=3, enable_prefix_caching=True)
    shadow = ShadowCache(4)
    a = Sequence(0, list(range(9)))
    compute(kv, shadow, a, 9)
    kv.free(0)
    assert kv.num_free_gpu_blocks == 3
    b = Sequence(1, list(range(9)))
    assert admit(kv, b) == 8
    shadow.check_seq(kv, b)
    kv.free(1)
    # Filling the cache with other tokens evicts the old prefix (lazily, when the blocks are needed).
    c = Sequence(2, [50 + i for i in range(12)])
    compute(kv, shadow, c, 12)
    kv.free(2)
    d = Sequence(3, list(range(9)))
    assert admit(kv, d) == 0
    assert kv.gpu_pool.num_evictions >= 2
    kv.free(3)
    kv.check_integrity()


def test_hash_collisions_are_misses_not_wrong_hits() -> None:
    # Every block hashes the same: only the token and parent comparison tells contents apart.
    kv = make(enable_prefix_caching=True, hash_fn=lambda parent, tokens: b"x")
    shadow = ShadowCache(4)
    a = Sequence(0, [1, 2, 3, 4, 5])
    compute(kv, shadow, a, 5)
    b = Sequence(1, [9, 9, 9, 9, 5])
    assert admit(kv, b) == 0
    c = Sequence(2, [1, 2, 3, 4, 7])
    assert admit(kv, c) == 4
    kv.check_integrity()


def test_chain_collision_with_another_parent_is_a_miss() -> None:
    # The hash ignores the parent: [0,1][5,5] and [1,0][5,5] collide on their second block.
    kv = make(bs=2, enable_prefix_caching=True, hash_fn=lambda parent, tokens: bytes([sum(tokens)]))
    shadow = ShadowCache(2)
    a = Sequence(0, [0, 1, 7])
    compute(kv, shadow, a, 3)
    b = Sequence(1, [1, 0, 5, 5, 3])  # block 0 collides with a's and stays private; block 1 is cached
    compute(kv, shadow, b, 5)
    c = Sequence(2, [0, 1, 5, 5, 3])  # block 0 hits a's; block 1 must not hit b's (other parent)
    assert admit(kv, c) == 2
    shadow.check_seq(kv, c)
    kv.check_integrity()


def cached_then_freed(kv: KVCacheManager, shadow: ShadowCache, seq_id: int, tokens: list[int]) -> list[int]:
    """Compute a sequence and free it: its full blocks stay cached in the free queue; returns its table."""
    seq = Sequence(seq_id, tokens)
    compute(kv, shadow, seq, len(tokens))
    table = kv.get_block_table(seq_id)
    kv.free(seq_id)
    return table


def test_lookup_prefix_changes_nothing() -> None:
    kv = make(num_gpu=10, enable_prefix_caching=True)
    shadow = ShadowCache(4)
    freed = cached_then_freed(kv, shadow, 0, list(range(12)))
    freed_later = cached_then_freed(kv, shadow, 7, [70 + i for i in range(8)])
    held = Sequence(1, [50 + i for i in range(9)])
    compute(kv, shadow, held, 9)  # its two full blocks are cached and in use
    free_queue = kv.gpu_pool.free_queue()
    # Free cached blocks sit at the back, least recently freed first: a lookup must not refresh them.
    assert free_queue[-5:] == (*reversed(freed), *reversed(freed_later))
    probes = [
        Sequence(2, list(range(12)) + [7]),  # hits three free cached blocks
        Sequence(3, [50 + i for i in range(8)] + [9]),  # hits two blocks in use
        Sequence(4, list(range(4)) + [99] * 5),  # hits one, then misses
        Sequence(5, [98] * 9),  # misses
        Sequence(6, [1]),  # nothing to look up
    ]
    before = manager_state(kv, range(7))
    hits = [kv.lookup_prefix(seq) for seq in probes]
    assert [kv.lookup_prefix(seq) for seq in probes] == hits  # again, from the hash memo
    assert manager_state(kv, range(7)) == before
    assert [h.num_tokens for h in hits] == [12, 8, 4, 0, 0]
    assert hits[0].block_ids == tuple(freed[:3]) and hits[1].block_ids == tuple(kv.get_block_table(1)[:2])
    assert all(len(h.block_hashes) == len(h.block_ids) for h in hits)
    kv.check_integrity(waiting_seq_ids=[2, 3, 4, 5, 6])
    # Taking a hit is what changes state: free cached hit blocks leave the free queue, the statistics count.
    kv.take_prefix(probes[0], hits[0])
    assert kv.gpu_pool.free_queue() == tuple(b for b in free_queue if b not in freed[:3])
    assert kv.get_block_table(2) == freed[:3]
    assert (kv.num_prefix_queried_blocks, kv.num_prefix_hit_blocks) == (3, 3)
    kv.check_integrity(waiting_seq_ids=[3, 4, 5, 6])


def test_blocks_needed_counts_each_free_hit_block_once() -> None:
    # A group preempted by recompute after forking: its sequences share their prompt, so they hit the same blocks.
    kv = make(num_gpu=10, enable_prefix_caching=True)
    shadow = ShadowCache(4)
    prompt = list(range(8))
    cached_then_freed(kv, shadow, 0, prompt + [8])  # blocks [0:4] and [4:8] cached, free
    group = [Sequence(1, prompt + [20, 21]), Sequence(2, prompt + [30, 31, 32, 33, 34])]
    hits = {seq.seq_id: kv.lookup_prefix(seq) for seq in group}
    assert hits[1].block_ids == hits[2].block_ids and len(hits[1].block_ids) == 2
    items = [(group[0], 2), (group[1], 5)]
    need = kv.blocks_needed(items, hits)
    assert need == 2 + 1 + 2  # the two shared hit blocks once, then 1 and 2 blocks past the hit
    free = kv.num_free_gpu_blocks
    for seq in group:
        kv.take_prefix(seq, hits[seq.seq_id])
        seq.num_computed_tokens = hits[seq.seq_id].num_tokens
    assert kv.allocate_group_slots(items) == []
    assert kv.num_free_gpu_blocks == free - need
    # Hit blocks in use cost nothing: a third sequence of the same prompt only needs its new block.
    third = Sequence(3, prompt + [40])
    assert kv.blocks_needed([(third, 1)], {3: kv.lookup_prefix(third)}) == 1
    kv.free(3)
    kv.check_integrity(waiting_seq_ids=())


def test_waiting_sequence_hashes_each_block_once() -> None:
    calls: list[tuple[int, ...]] = []

    def counting_hash(parent: BlockHash | None, tokens: tuple[int, ...]) -> BlockHash:
        calls.append(tokens)
        return hash_block_tokens(parent, tokens)

    kv = make(num_gpu=10, enable_prefix_caching=True, hash_fn=counting_hash)
    shadow = ShadowCache(4)
    cached_then_freed(kv, shadow, 0, list(range(17)))  # four full blocks cached
    calls.clear()
    blocked = Sequence(1, list(range(8)) + [50, 51, 52, 53, 54])  # blocks 0 and 1 hit, block 2 misses
    for _ in range(5):
        assert kv.lookup_prefix(blocked).num_tokens == 8
    assert calls == [(0, 1, 2, 3), (4, 5, 6, 7), (50, 51, 52, 53)]  # the miss is hashed once too
    calls.clear()
    growing = Sequence(2, list(range(9)))
    assert kv.lookup_prefix(growing).num_tokens == 8
    # Appending (a recompute's pending tokens resolving) adds a candidate block: only that one is hashed.
    for token in (9, 10, 11, 12):
        growing.append_token(token)
    assert kv.lookup_prefix(growing).num_tokens == 12
    assert calls == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    kv.free(2)  # aborted while waiting
    kv.check_integrity(waiting_seq_ids=[1])
    with pytest.raises(AssertionError):
        kv.check_integrity(waiting_seq_ids=[])  # the memo outlived the wait
    kv.take_prefix(blocked, kv.lookup_prefix(blocked))
    kv.check_integrity(waiting_seq_ids=[])  # admitted: the memo is gone


def test_lookup_skips_blocks_holding_pending_tokens() -> None:
    kv = make(num_gpu=10, enable_prefix_caching=True)
    shadow = ShadowCache(4)
    cached_then_freed(kv, shadow, 0, list(range(13)))
    seq = Sequence(1, list(range(6)))
    seq.add_pending()
    seq.add_pending()
    seq.add_pending()  # 9 tokens, the last three still on the device: block 1 is not known yet
    assert kv.lookup_prefix(seq).num_tokens == 4
    for token in (6, 7, 8):
        seq.resolve_pending(token)
    hit = kv.lookup_prefix(seq)  # the memo holds no hash of a partial block 1: now it hits
    assert hit.num_tokens == 8
    kv.take_prefix(seq, hit)
    seq.num_computed_tokens = 8
    shadow.check_seq(kv, seq)


def test_take_prefix_refuses_a_hit_gone_stale() -> None:
    kv = make(num_gpu=3, enable_prefix_caching=True)
    shadow = ShadowCache(4)
    cached_then_freed(kv, shadow, 0, list(range(5)))
    seq = Sequence(1, list(range(5)))
    hit = kv.lookup_prefix(seq)
    assert hit.num_tokens == 4
    compute(kv, shadow, Sequence(2, [9] * 12), 12)  # takes every block: the hit block is evicted and reused
    with pytest.raises(AssertionError, match="stale"):
        kv.take_prefix(seq, hit)


def test_watermark_and_sizes_are_checked() -> None:
    kv = KVCacheManager(16, 100, 10, watermark=0.05)
    assert kv.watermark_blocks == 5
    with pytest.raises(ValueError):
        KVCacheManager(16, 4, 0, watermark=1.0)
    with pytest.raises(ValueError):
        KVCacheManager(0, 4, 0)


def test_check_integrity_catches_corruption() -> None:
    kv = make()
    seq = Sequence(0, list(range(5)))
    kv.allocate_slots(seq, 5)
    kv.check_integrity()
    kv.gpu_pool.blocks[kv.get_block_table(0)[0]].ref_count += 1
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_a_sequence_that_does_not_read_the_cache_gets_no_hit_and_is_not_counted() -> None:
    kv = make(num_gpu=10, enable_prefix_caching=True)
    shadow = ShadowCache(4)
    cached_then_freed(kv, shadow, 0, list(range(12)))
    scored = Sequence(1, list(range(12)) + [5])
    hit = kv.lookup_prefix(scored, read=False)
    assert hit.num_tokens == 0 and not hit.queried
    kv.take_prefix(scored, hit)
    assert (kv.num_prefix_queried_blocks, kv.num_prefix_hit_blocks) == (0, 0)
    compute(kv, shadow, scored, 13)  # its own copies of the blocks; the cached ones stay findable
    assert kv.lookup_prefix(Sequence(2, list(range(12)) + [6])).num_tokens == 12
    kv.check_integrity(waiting_seq_ids=[2])


def test_reset_prefix_cache_only_when_no_block_is_held() -> None:
    kv = make(num_gpu=10, enable_prefix_caching=True)
    shadow = ShadowCache(4)
    cached_then_freed(kv, shadow, 0, list(range(12)))
    held = Sequence(1, [50 + i for i in range(9)])
    compute(kv, shadow, held, 9)
    assert not kv.reset_prefix_cache()  # a block is held: nothing changes
    assert kv.lookup_prefix(Sequence(2, list(range(12)) + [7])).num_tokens == 12
    kv.free(1)
    assert kv.reset_prefix_cache()
    assert kv.gpu_pool.num_cached_blocks == 0 and kv.num_free_gpu_blocks == 10
    assert kv.lookup_prefix(Sequence(3, list(range(12)) + [7])).num_tokens == 0
    kv.check_integrity(waiting_seq_ids=[2, 3])


def test_sliding_window_releases_what_the_next_token_cannot_see() -> None:
    """Window 5, blocks of 4: after computing n tokens, blocks wholly below position n - 4 are released (their
    entries NULL_BLOCK, a prefix of the table); a hit longer than the window is taken, then released at once
    (its blocks stay cached for the next hit); a fork shares only what is held."""
    from tinypaged.core.kv_cache_manager import NULL_BLOCK

    kv, shadow = make(num_gpu=12, bs=4, enable_prefix_caching=True, sliding_window=5), ShadowCache(4, 5)
    seq = Sequence(0, list(range(21)))
    admit(kv, seq)
    for n in (8, 8, 4):
        compute(kv, shadow, seq, n)
        kv.free_out_of_window(seq)
        kv.check_integrity()
    table = kv.get_block_table(0)
    assert table[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in table[4:]  # 20 computed: keys from 16 on
    shadow.check_seq(kv, seq)
    other = Sequence(1, list(range(21)))
    assert admit(kv, other) == 20
    kv.free_out_of_window(other)
    assert kv.get_block_table(1)[:4] == [NULL_BLOCK] * 4
    kv.fork(1, 2)
    kv.check_integrity()
    kv.free(0)
    kv.free(1)
    kv.free(2)
    kv.check_integrity()
    assert kv.num_free_gpu_blocks == 12
