"""A stand-in for the KV cache tensors: each slot holds the exact prefix its K/V would depend on."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tinypaged.core.kv_cache_manager import CacheSnapshot, KVCacheManager
from tinypaged.core.scheduler import Scheduler, SchedulerOutput
from tinypaged.core.sequence import Sequence, SequenceStatus

Slot = tuple[int, ...]  # token ids [0 .. position] that produced this slot's K/V


class ShadowCache:
    """Does what the model runner would do with copies, swaps and writes, on tuples instead of tensors. Under a
    sliding `window` (every layer's), only the positions the next token sees must be intact."""

    def __init__(self, block_size: int, window: int | None = None) -> None:
        self.block_size = block_size
        self.window = window
        self.gpu: dict[tuple[int, int], Slot] = {}
        self.cpu: dict[tuple[int, int], Slot] = {}

    def _copy(self, pairs: Iterable[tuple[int, int]], src: dict, dst: dict) -> None:
        pairs = list(pairs)
        assert len({d for _, d in pairs}) == len(pairs), f"two copies into one block: {pairs}"
        snapshot = {(b, o): src.get((b, o)) for b, _ in pairs for o in range(self.block_size)}
        for s, d in pairs:
            for o in range(self.block_size):
                dst.pop((d, o), None)
                if snapshot[(s, o)] is not None:
                    dst[(d, o)] = snapshot[(s, o)]

    def swap_out(self, pairs: Iterable[tuple[int, int]]) -> None:
        self._copy(pairs, self.gpu, self.cpu)

    def swap_in(self, pairs: Iterable[tuple[int, int]]) -> None:
        self._copy(pairs, self.cpu, self.gpu)

    def copy(self, pairs: Iterable[tuple[int, int]]) -> None:
        self._copy(pairs, self.gpu, self.gpu)

    def apply(self, out: SchedulerOutput) -> None:
        """The block moves of one step, in the runner's order."""
        self.swap_out(out.blocks_to_swap_out)
        self.swap_in(out.blocks_to_swap_in)
        self.copy(out.blocks_to_copy)

    def write(self, block_table: Iterable[int], token_ids: list[int], start: int, num: int) -> None:
        """Compute positions [start, start + num) of a sequence into its block table."""
        table = list(block_table)
        bs = self.block_size
        assert len(table) >= -(-(start + num) // bs), "block table does not cover the new tokens"
        for pos in range(start, start + num):
            self.gpu[(table[pos // bs], pos % bs)] = tuple(token_ids[: pos + 1])

    def check_prefix(
        self, block_table: Iterable[int], token_ids: list[int], upto: int, on_cpu: bool = False
    ) -> None:
        """Every position below upto (within the window of position upto, under one) holds the K/V of exactly this
        sequence's prefix."""
        table = list(block_table)
        bs = self.block_size
        store = self.cpu if on_cpu else self.gpu
        assert len(table) >= -(-upto // bs), f"block table {table} does not cover {upto} computed tokens"
        for pos in range(0 if self.window is None else max(0, upto - self.window + 1), upto):
            got = store.get((table[pos // bs], pos % bs))
            assert got == tuple(token_ids[: pos + 1]), f"slot for position {pos} holds {got}, not the prefix"

    def check_seq(self, kv: KVCacheManager, seq: Sequence) -> None:
        """The computed part of a sequence is intact wherever its blocks are."""
        self.check_prefix(
            kv.get_block_table(seq.seq_id), seq.token_ids, seq.num_computed_tokens, kv.is_swapped(seq.seq_id)
        )


def manager_state(kv: KVCacheManager, seq_ids: Iterable[int]) -> tuple[Any, ...]:
    """What a pure call must leave alone: every block (ref count, content, cache entry), the free queues in
    order, these sequences' block tables, the prefix statistics and the eviction count."""
    pools = tuple(
        (
            tuple((b.ref_count, b.content_id, b.block_hash, b.parent_id, b.token_ids) for b in pool.blocks),
            pool.free_queue(),
            pool.num_cached_blocks,
            pool.num_evictions,
        )
        for pool in (kv.gpu_pool, kv.cpu_pool)
    )
    tables = {i: (kv.get_block_table(i), kv.is_swapped(i)) for i in seq_ids}
    return pools, tables, kv.num_prefix_queried_blocks, kv.num_prefix_hit_blocks


def run_step(sched: Scheduler, shadow: ShadowCache, next_token: int = 7) -> SchedulerOutput:
    """One engine step against the shadow cache: schedule, move blocks, check and write, update, sample."""
    kv = sched.kv
    out = sched.schedule()
    shadow.apply(out)
    seen: set[int] = set()
    for s in out.scheduled:
        assert s.seq_id not in seen, "a sequence scheduled twice in one step"
        seen.add(s.seq_id)
        seq = sched.get_seq(s.seq_id)
        assert seq is not None and seq.status == SequenceStatus.RUNNING and not kv.is_swapped(s.seq_id)
        assert s.num_computed_tokens == seq.num_computed_tokens and s.num_new_tokens > 0
        end = s.num_computed_tokens + s.num_new_tokens
        assert s.token_ids == tuple(seq.token_ids[s.num_computed_tokens : end])
        assert s.do_sample == (end == seq.num_tokens)
        # Attention reads the computed prefix through this block table: it must hold exactly that prefix.
        shadow.check_prefix(s.block_table, seq.token_ids, s.num_computed_tokens)
        if kv.sliding_window is not None:  # a chunk of C tokens under a window holds its blocks and C's
            held = [b for b in s.block_table if b >= 0]
            assert len(held) <= -(-(kv.sliding_window + s.num_new_tokens) // kv.block_size) + 1, s.block_table
        shadow.write(s.block_table, seq.token_ids, s.num_computed_tokens, s.num_new_tokens)
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert len(out.scheduled) <= sched.config.max_num_seqs
    sched.update_from_output(out)
    for s in out.scheduled:
        if s.do_sample:
            seq = sched.get_seq(s.seq_id)
            assert seq is not None
            seq.append_token(next_token)
    kv.check_integrity(waiting_seq_ids=[seq.seq_id for group in sched.waiting for seq in group.seqs])
    return out


def check_snapshot(kv: KVCacheManager, snap: CacheSnapshot, request_ids: Mapping[int, str]) -> None:
    """A snapshot agrees with the block tables as check_integrity reads them: per pool, each block's ref count
    is the number of tables holding it, its holders are the requests of those tables (each once), and the
    cached blocks are those with a prefix-cache identity. `request_ids`: seq id -> request id, for every seq."""
    assert snap.block_size == kv.block_size
    for on_cpu, pool, view in ((False, kv.gpu_pool, snap.gpu), (True, kv.cpu_pool, snap.cpu)):
        refs = [0] * pool.num_blocks
        holders: dict[int, set[str]] = {}
        for seq_id, request_id in request_ids.items():
            if kv.is_swapped(seq_id) != on_cpu:
                continue
            for block_id in kv.get_block_table(seq_id):
                if block_id < 0:
                    continue  # released under a sliding window
                refs[block_id] += 1
                holders.setdefault(block_id, set()).add(request_id)
        assert view.ref_counts == tuple(refs) == tuple(pool.ref_count(b) for b in range(pool.num_blocks))
        assert {b: set(h) for b, h in view.holders.items()} == holders
        assert all(len(set(h)) == len(h) for h in view.holders.values()), "a request named twice"
        assert view.cached == {b.block_id for b in pool.blocks if b.block_hash is not None}
