"""Reservation-based KV memory (the vLLM paper's Orca baselines): each sequence holds one contiguous extent of
the GPU block pool, reserved up front for its whole output, in a linear address space with a first-fit
allocator, so that external fragmentation is real rather than modelled.

The extent is rounded to whole blocks and a sequence's block table is its extent's consecutive blocks, so the
paged kernels and the batching run unchanged: only the memory policy differs, as in the paper's baselines.
Nothing is shared (no prefix cache, no copy-on-write: a forked sample or beam reserves its own extent and
copies its parent's blocks into it), nothing is swapped (preemption recomputes, freeing the whole extent).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable, Mapping

from tinypaged.core.kv_cache_manager import CacheSnapshot, KVCacheManager, PrefixHit, cdiv
from tinypaged.core.sequence import Sequence, SequenceGroup

KV_RESERVATIONS = ("paged", "orca-oracle", "orca-pow2", "orca-max")


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (n >= 1): 25 -> 32, 32 -> 32."""
    return 1 << (n - 1).bit_length()


def reserved_tokens(policy: str, prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """Token slots an Orca policy reserves for a sequence: orca-oracle the prompt plus its exact output length
    (`max_tokens`: the true length only where the workload decodes exactly max_tokens, ignoring EOS, as the
    paper's benchmark does), orca-pow2 the prompt plus that length rounded up to a power of two, orca-max
    max_model_len; never more than max_model_len. No max_tokens: the output may run to max_model_len."""
    output = max_model_len - prompt_len if max_tokens is None else max_tokens
    if policy == "orca-oracle":
        want = prompt_len + output
    elif policy == "orca-pow2":
        want = prompt_len + next_power_of_two(max(1, output))
    elif policy == "orca-max":
        want = max_model_len
    else:
        raise ValueError(
            f"not a reservation policy: {policy!r}; the choices are {', '.join(KV_RESERVATIONS)}"
        )
    return min(want, max_model_len)


class LinearKVAllocator:
    """A line of `num_slots` units (here: blocks) handed out as contiguous extents, first fit (the lowest
    offset whose free run is long enough). Free runs are kept sorted by offset and coalesce on free."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[tuple[int, int]] = [(0, num_slots)] if num_slots else []  # (offset, length)
        self._held: dict[int, int] = {}  # offset -> length

    @property
    def num_free(self) -> int:
        """Free units in total, whatever their runs."""
        return sum(n for _, n in self._free)

    def extents(self) -> dict[int, int]:
        """The held extents: offset -> length (a copy)."""
        return dict(self._held)

    def find(self, n: int) -> int | None:
        """The offset allocate(n) would take, or None; changes nothing."""
        for offset, length in self._free:
            if length >= n:
                return offset
        return None

    def allocate(self, n: int) -> int | None:
        """Take the first free run of at least n units (n >= 1); its offset, or None if no run is long enough
        (however many units are free in total: that is external fragmentation)."""
        if n < 1:
            raise ValueError(f"an extent needs at least one unit, got {n}")
        for i, (offset, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (offset + n, length - n)
                self._held[offset] = n
                return offset
        return None

    def free(self, offset: int) -> None:
        """Give back the extent at `offset`, merging it with free neighbours."""
        n = self._held.pop(offset)
        i = bisect.bisect_left(self._free, (offset, 0))
        start, end = offset, offset + n
        if i < len(self._free) and self._free[i][0] == end:
            end += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == start:
            start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (start, end - start))

    def largest_free_extent(self) -> int:
        """The longest free run (0 when none is free)."""
        return max((n for _, n in self._free), default=0)

    def check_integrity(self) -> None:
        """Assert extents and free runs never overlap, free runs are sorted and coalesced, and free + held
        == num_slots."""
        runs = sorted([(o, n, False) for o, n in self._free] + [(o, n, True) for o, n in self._held.items()])
        pos = 0
        prev_free = False
        for offset, n, held in runs:
            assert n >= 1, f"empty run at {offset}"
            assert offset == pos, f"gap or overlap at {pos}..{offset}"
            assert held or not prev_free, f"free runs not coalesced at {offset}"
            prev_free = not held
            pos += n
        assert pos == self.num_slots, f"free + held = {pos} != {self.num_slots}"
        assert self._free == sorted(self._free)


class ReservingKVCacheManager(KVCacheManager):
    """A KV cache manager under an Orca policy: a sequence's first allocation reserves its whole extent (blocks
    held by the reservation, ref count 1 each); its block table then grows over the extent's consecutive
    blocks and can never pass the extent's end. Fork gives the child an extent of its own and queues copies of
    the parent's blocks (`take_copies`), or, when no extent fits at once, leaves the child to recompute."""

    reserving = True
    outgrown = (
        "its sequences' reservations do not fit the KV cache together (each sample or beam reserves its own "
        "extent; a beam search needs every beam's at once)"
    )

    def __init__(
        self, policy: str, max_model_len: int, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int
    ) -> None:
        if policy not in KV_RESERVATIONS[1:]:
            raise ValueError(f"not an Orca policy: {policy!r}")
        # No prefix cache and no swapping: the paper's Orca baselines share nothing and recompute.
        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark=0.0)
        self.policy = policy
        self.max_model_len = max_model_len
        self.line = LinearKVAllocator(num_gpu_blocks)
        self._extents: dict[int, tuple[int, int]] = {}  # seq id -> (first block, blocks)
        self._reserve: dict[int, int] = {}  # seq id -> the blocks it reserves (set when added)
        self._copies: list[tuple[int, int]] = []

    # ---- reservation sizes ---------------------------------------------------------------------------
    def register(self, group: SequenceGroup) -> None:
        """Record the reservation of each of the group's sequences (from its prompt and max_tokens)."""
        for seq in group.seqs:
            self._reserve[seq.seq_id] = self._blocks_for(seq, group.max_tokens)

    def _blocks_for(self, seq: Sequence, max_tokens: int | None) -> int:
        tokens = reserved_tokens(self.policy, seq.prompt_len, max_tokens, self.max_model_len)
        return cdiv(max(tokens, seq.num_tokens), self.block_size)

    def blocks_to_admit(self, seqs: Iterable[Sequence]) -> int:
        """The blocks these sequences reserve together (each its own extent)."""
        return sum(self._reserve[s.seq_id] for s in seqs)

    def can_admit(
        self, items: list[tuple[Sequence, int]], hits: Mapping[int, PrefixHit], reserve: int
    ) -> bool:
        """Whether first fit finds an extent for every new sequence among `items`, in order (the watermark is
        moot: a reserved sequence never grows past its extent)."""
        trial = LinearKVAllocator(0)
        trial._free, trial._held = list(self.line._free), dict(self.line._held)
        return all(
            s.seq_id in self._extents or trial.allocate(self._reserve[s.seq_id]) is not None for s, _ in items
        )

    # ---- allocation ----------------------------------------------------------------------------------
    def allocate_group_slots(self, items: list[tuple[Sequence, int]]) -> list[tuple[int, int]] | None:
        """Reserve the extent of each sequence that has none (all or nothing), then extend each block table over
        its extent; never past it (RuntimeError: the reservation was wrong)."""
        new = [s for s, _ in items if s.seq_id not in self._extents]
        taken: list[int] = []
        for seq in new:
            if not self._take_extent(seq.seq_id):
                for seq_id in taken:
                    self._release(seq_id)
                return None
            taken.append(seq.seq_id)
        for seq, num_new in items:
            first, length = self._extents[seq.seq_id]
            need = cdiv(seq.num_computed_tokens + num_new, self.block_size)
            if need > length:
                raise RuntimeError(f"seq {seq.seq_id} would write past its reservation of {length} blocks")
            table = self._tables.setdefault(seq.seq_id, [])
            table.extend(range(first + len(table), first + need))
        return []

    def _take_extent(self, seq_id: int) -> bool:
        n = self._reserve[seq_id]
        offset = self.line.allocate(n)
        if offset is None:
            return False
        for block_id in range(offset, offset + n):
            self.gpu_pool.incref(block_id)  # the reservation holds every block of it
        self._extents[seq_id] = (offset, n)
        return True

    def _release(self, seq_id: int) -> None:
        offset, n = self._extents.pop(seq_id)
        self._tables.pop(seq_id, None)
        for block_id in range(offset, offset + n):
            self.gpu_pool.free(block_id)
        self.line.free(offset)

    def free(self, seq_id: int) -> None:
        """Give back the sequence's whole extent (finish, abort or preemption)."""
        if seq_id in self._extents:
            self._release(seq_id)
        self._tables.pop(seq_id, None)

    def forget(self, seq_id: int) -> None:
        """The sequence has left the scheduler: drop its reservation size too."""
        self.free(seq_id)
        self._reserve.pop(seq_id, None)

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child reserves its own extent (as large as the parent's) and its table's blocks are copies of the
        parent's; with no extent free, it gets none and recomputes its tokens when it next runs."""
        self._reserve[child_seq_id] = self._reserve[parent_seq_id]
        table = self._tables.get(parent_seq_id)
        if not table or not self._take_extent(child_seq_id):
            return
        first = self._extents[child_seq_id][0]
        child = list(range(first, first + len(table)))
        self._tables[child_seq_id] = child
        self._copies.extend(zip(table, child, strict=True))

    def take_prefix(self, seq: Sequence, hit: PrefixHit) -> None:
        """Admission: no prefix is shared, and the extent is taken by the sequence's first allocation."""
        assert not hit.block_ids, "a prefix hit under a reservation policy"
        self._waiting_hashes.pop(seq.seq_id, None)

    def take_copies(self) -> list[tuple[int, int]]:
        """The fork copies queued since the last call: (parent block, child block), for the next step to run
        before its forward pass (the parent's blocks are not written before then)."""
        copies, self._copies = self._copies, []
        return copies

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Never: preemption under an Orca policy recomputes, freeing the whole extent."""
        return False

    def snapshot(self, request_ids: Mapping[int, str]) -> CacheSnapshot:
        """As the paged manager's, each extent's every block held by its sequence's request (it is reserved
        whether written or not)."""
        gpu = {
            b: (request_ids[seq_id],)
            for seq_id, (offset, n) in self._extents.items()
            for b in range(offset, offset + n)
        }
        return CacheSnapshot(self.block_size, self.gpu_pool.snapshot(gpu), self.cpu_pool.snapshot({}))

    # ---- waste ---------------------------------------------------------------------------------------
    def reservation_stats(self) -> tuple[int, int]:
        """(blocks reserved but not yet in any block table, the largest free extent in blocks)."""
        unused = sum(n - len(self._tables.get(s, ())) for s, (_, n) in self._extents.items())
        return unused, self.line.largest_free_extent()

    # ---- invariants ----------------------------------------------------------------------------------
    def check_integrity(self, waiting_seq_ids: Collection[int] | None = None) -> None:
        """Extents never overlap (the line's check), each sequence's table is a prefix of its extent, and the
        pool's ref counts are exactly one per reserved block."""
        self.line.check_integrity()
        assert {o: n for o, n in self._extents.values()} == self.line.extents(), "extents != the line's"
        refs: dict[int, int] = {}
        for seq_id, (offset, n) in self._extents.items():
            table = self._tables.get(seq_id, [])
            assert table == list(range(offset, offset + len(table))) and len(table) <= n, (
                f"seq {seq_id}: table {table} is not a prefix of its extent {offset}+{n}"
            )
            refs.update(dict.fromkeys(range(offset, offset + n), 1))
        assert self._tables.keys() <= self._extents.keys(), "a block table without an extent"
        assert not self._on_cpu, "swapped under an Orca policy"
        self.gpu_pool.check_integrity(refs)
        self.cpu_pool.check_integrity({})


def make_kv_cache_manager(
    policy: str,
    block_size: int,
    num_gpu_blocks: int,
    num_cpu_blocks: int,
    max_model_len: int,
    enable_prefix_caching: bool,
    sliding_window: int | None,
) -> KVCacheManager:
    """The KV cache manager of a reservation policy: paged, or reserving under an Orca policy (which ignores
    prefix caching and the sliding window: an extent is held whole until its sequence ends)."""
    if policy == "paged":
        return KVCacheManager(
            block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
            sliding_window=sliding_window,
        )
    return ReservingKVCacheManager(policy, max_model_len, block_size, num_gpu_blocks, num_cpu_blocks)
