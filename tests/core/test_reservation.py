"""The Orca reservation policies' pieces: reservation sizes and the first-fit linear allocator."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinypaged.core.reservation import LinearKVAllocator, ReservingKVCacheManager, reserved_tokens
from tinypaged.core.sequence import Sequence, SequenceGroup


def test_reserved_tokens_per_policy() -> None:
    assert reserved_tokens("orca-oracle", 10, 25, 2048) == 35
    assert reserved_tokens("orca-pow2", 10, 25, 2048) == 42  # 25 -> 32
    assert reserved_tokens("orca-pow2", 10, 32, 2048) == 42
    assert reserved_tokens("orca-pow2", 1000, 1025, 2048) == 2048  # 2048 + 1000, capped
    assert reserved_tokens("orca-max", 10, 25, 2048) == 2048
    assert reserved_tokens("orca-oracle", 10, None, 2048) == 2048  # no bound: up to max_model_len
    with pytest.raises(ValueError, match="orca-oracle"):
        reserved_tokens("orca", 10, 25, 2048)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(size=st.integers(1, 40), ops=st.lists(st.tuples(st.booleans(), st.integers(1, 12)), max_size=60))
def test_linear_allocator_first_fit(size: int, ops: list[tuple[bool, int]]) -> None:
    """Against a model of the line as a list of owners: allocate takes the lowest run of n free slots (None
    only when there is none, however many are free), extents never overlap, free restores the slots and
    coalesces, and largest_free_extent is the longest free run."""
    line = LinearKVAllocator(size)
    owner: list[int | None] = [None] * size
    held: list[int] = []
    for alloc, n in ops:
        if alloc or not held:
            want = next((o for o in range(size - n + 1) if all(x is None for x in owner[o : o + n])), None)
            got = line.allocate(n)
            assert got == want, (got, want, owner)
            if got is not None:
                owner[got : got + n] = [got] * n
                held.append(got)
        else:
            offset = held.pop(n % len(held))
            line.free(offset)
            owner = [None if x == offset else x for x in owner]
        line.check_integrity()
        runs, run = [], 0
        for x in owner + [0]:
            run = run + 1 if x is None else 0
            runs.append(run)
        assert line.largest_free_extent() == max(runs)
        assert line.num_free == owner.count(None)
    for offset in held:
        line.free(offset)
    line.check_integrity()
    assert line.largest_free_extent() == size


def test_external_fragmentation_refuses_admission() -> None:
    """Enough blocks free in total but no run long enough: the reservation fails (first fit, no moving)."""
    kv = ReservingKVCacheManager("orca-oracle", 64, 2, 6, 0)
    seqs = [Sequence(i, [1, 2]) for i in range(3)]
    for seq in seqs:
        kv.register(SequenceGroup(str(seq.seq_id), [seq], 0.0, max_tokens=2))  # 4 tokens: 2 blocks each
        assert kv.allocate_slots(seq, 2) == []
    kv.free(seqs[0].seq_id)
    kv.free(seqs[2].seq_id)
    assert kv.num_free_gpu_blocks == 4 and kv.reservation_stats() == (
        1,
        2,
    )  # seq 1 wrote 1 of 2; free: two runs of 2
    big = Sequence(9, [1, 2, 3])
    kv.register(SequenceGroup("big", [big], 0.0, max_tokens=3))  # 6 tokens: 3 blocks
    assert not kv.can_admit([(big, 3)], {}, 0)
    assert kv.allocate_slots(big, 3) is None
    kv.check_integrity()
    kv.free(seqs[1].seq_id)
    assert kv.allocate_slots(big, 3) == [] and kv.get_block_table(9) == [0, 1]
    kv.check_integrity()
