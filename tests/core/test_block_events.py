"""BlockPool's prefix-cache events: replayed from the start, they give exactly the hashes the pool maps."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinypaged.core.block_pool import BlockEvent, BlockPool, hash_block_tokens


def replay(events: list[BlockEvent], into: set[bytes]) -> None:
    """Apply events as a subscriber would, checking each is possible (no double store, no unknown remove)."""
    for kind, block_hash in events:
        if kind == "cleared":
            into.clear()
        elif kind == "stored":
            assert block_hash not in into, "stored twice without a remove"
            into.add(block_hash)
        else:
            assert block_hash in into, "removed a hash never stored"
            into.remove(block_hash)


OPS = st.lists(
    st.tuples(st.sampled_from(["allocate", "free", "incref", "cache", "reset", "take"]), st.integers(0, 7)),
    max_size=80,
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS, num_blocks=st.integers(1, 6))
def test_replayed_events_equal_the_cached_hashes(ops: list[tuple[str, int]], num_blocks: int) -> None:
    pool = BlockPool(num_blocks, enable_caching=True)
    held: list[int] = []  # one entry per reference taken
    seen: set[bytes] = set()
    for op, arg in ops:
        if op == "allocate" and pool.num_free_blocks:
            held.append(pool.allocate())
        elif op == "free" and held:
            pool.free(held.pop(arg % len(held)))
        elif op == "incref" and held:
            held.append(held[arg % len(held)])
            pool.incref(held[-1])
        elif op == "cache" and held:
            # Few distinct contents, so that the same hash is cached, evicted and cached again.
            tokens = (arg % 3, arg % 2)
            pool.cache_block(held[arg % len(held)], hash_block_tokens(None, tokens), None, tokens)
        elif op == "reset":
            pool.reset_cache()
        elif op == "take":
            replay(pool.take_events(), seen)
            assert seen == pool.cached_hashes()
    replay(pool.take_events(), seen)
    assert seen == pool.cached_hashes()
    assert pool.take_events() == []


def test_eviction_and_reset_are_reported_in_order() -> None:
    pool = BlockPool(1, enable_caching=True)
    b = pool.allocate()
    h = hash_block_tokens(None, (1, 2))
    pool.cache_block(b, h, None, (1, 2))
    pool.free(b)
    pool.allocate()  # evicts h
    assert pool.take_events() == [BlockEvent("stored", h), BlockEvent("removed", h)]
    pool.free(0)
    pool.cache_block(pool.allocate(), h, None, (1, 2))
    pool.free(0)
    assert pool.reset_cache()
    assert [e.kind for e in pool.take_events()] == ["stored", "cleared"]
    assert pool.cached_hashes() == frozenset()
