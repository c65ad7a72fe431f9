"""Block tables over a GPU and a CPU block pool: allocation, copy-on-write, fork, swap, prefix caching, and the
release of blocks that a sliding window has passed."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from tinypaged.core.block_pool import BlockHash, BlockPool, HashFn, PoolSnapshot, hash_block_tokens
from tinypaged.core.sequence import Sequence, SequenceGroup

# A block-table entry whose block was released: every layer's window has passed its positions, which the
# attention never reads again (kernels/attention.py). Such entries are a prefix of a table.
NULL_BLOCK = -1


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached full blocks a sequence's tokens begin with, as found by lookup_prefix (nothing taken yet)."""

    block_ids: tuple[int, ...]
    # Per hit block: (chained hash, content_id the next block chains to), as cache_block records them.
    block_hashes: tuple[tuple[BlockHash, int], ...]
    num_tokens: int  # tokens these blocks hold: the sequence's num_computed_tokens once they are taken
    queried: bool = True  # False: the cache was not read for this sequence (it counts in no hit rate)


_NO_HIT = PrefixHit((), (), 0)
_NOT_READ = PrefixHit((), (), 0, queried=False)


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """Both block pools as they stood between two steps (`KVCacheManager.snapshot`): plain data to draw the cache
    from, holding request ids and counts only."""

    block_size: int
    gpu: PoolSnapshot
    cpu: PoolSnapshot  # the swap pool: swapped-out groups hold its blocks


class KVCacheManager:
    """Maps each sequence's token positions to physical blocks (its block table), keeping ref counts right.

    `sliding_window`: the window of a model whose every layer attends to its last `sliding_window` positions
    only; a sequence then gives back the blocks that its next token can no longer see (`free_out_of_window`), so
    that one longer than the window holds about window / block_size blocks. None (a layer sees everything, as a
    global layer among Gemma 3's windowed ones does): every block is kept."""

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        hash_fn: HashFn = hash_block_tokens,
        sliding_window: int | None = None,
    ) -> None:
        if block_size <= 0 or num_gpu_blocks <= 0 or num_cpu_blocks < 0:
            raise ValueError(f"bad cache sizes: {block_size=} {num_gpu_blocks=} {num_cpu_blocks=}")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        # Admission keeps this many blocks free so running sequences can grow without preempting at once.
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        if not 0 <= self.watermark_blocks < num_gpu_blocks:
            raise ValueError(f"watermark {watermark} leaves no usable block out of {num_gpu_blocks}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"bad sliding window {sliding_window}")
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.gpu_pool = BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks)
        self._hash_fn = hash_fn
        self._tables: dict[int, list[int]] = {}
        self._on_cpu: set[int] = set()  # seq ids whose table holds CPU blocks (swapped out)
        # Per sequence, for its leading full computed blocks: (chained hash, content_id that the next block
        # chains to). Prefix caching only.
        self._block_hashes: dict[int, list[tuple[BlockHash, int]]] = {}
        # Per waiting sequence (no block table yet): the chained hashes of its leading full blocks, so a request
        # that waits many steps hashes each block once. They depend on token ids alone, which only grow by
        # appends while a sequence waits. Dropped when it is admitted (take_prefix) or freed.
        self._waiting_hashes: dict[int, list[BlockHash]] = {}
        # Counted once per admitted sequence (take_prefix), not per lookup.
        self.num_prefix_queried_blocks = 0
        self.num_prefix_hit_blocks = 0

    # Under an Orca reservation policy (core/reservation.py) a sequence holds one contiguous extent instead.
    reserving = False
    # Why a running group alone on the GPU ends when one of its sequences still does not fit.
    outgrown = "the sequence outgrew the whole KV cache"

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def num_free_gpu_blocks(self) -> int:
        """Free GPU blocks (cached-but-unused ones count: they are evicted on demand)."""
        return self.gpu_pool.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        """Free CPU (swap) blocks."""
        return self.cpu_pool.num_free_blocks

    @property
    def gpu_usage(self) -> float:
        """Fraction of GPU blocks held by some block table, 0..1."""
        return 1.0 - self.gpu_pool.num_free_blocks / self.num_gpu_blocks

    def get_block_table(self, seq_id: int) -> list[int]:
        """The sequence's block table (a copy); empty if it holds no blocks."""
        return list(self._tables.get(seq_id, ()))

    def is_swapped(self, seq_id: int) -> bool:
        """True while the sequence's blocks live in the CPU pool."""
        return seq_id in self._on_cpu

    def blocks_needed(
        self, items: Iterable[tuple[Sequence, int]], hits: Mapping[int, PrefixHit] | None = None
    ) -> int:
        """New blocks that allocate_slots would take for these (seq, num_new_tokens), in this order; with hits
        (seq id -> its lookup_prefix hit, not taken yet), the free blocks that taking them first would use too."""
        # Simulates copy-on-write ref counts locally: after one sibling copies a shared block, the next may
        # write into it in place. Exact, so a group allocation that passes this check cannot fail midway.
        hits = hits or {}
        # A free cached block that a hit takes leaves the free queue: it costs a block like a new one, once
        # however many sequences of the group hit it.
        need = (
            len({b for hit in hits.values() for b in hit.block_ids if self.gpu_pool.ref_count(b) == 0})
            if hits
            else 0
        )
        local_refs: dict[int, int] = {}
        for seq, num_new in items:
            hit = hits.get(seq.seq_id)
            if hit is not None:
                # Not taken yet: its table will be the hit, whole blocks, so its new tokens start a new block.
                assert seq.seq_id not in self._tables, f"seq {seq.seq_id} already holds a block table"
                need += cdiv(num_new, self.block_size)
                continue
            table = self._tables.get(seq.seq_id, [])
            pool = self.cpu_pool if seq.seq_id in self._on_cpu else self.gpu_pool
            first, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            for i in range(first // self.block_size, min(len(table), cdiv(end, self.block_size))):
                refs = local_refs.get(table[i], pool.ref_count(table[i]))
                if refs > 1:
                    need += 1
                    local_refs[table[i]] = refs - 1
            need += max(0, cdiv(end, self.block_size) - len(table))
        return need

    # ---- admission hooks (a reservation policy overrides them) ---------------------------------------
    def register(self, group: SequenceGroup) -> None:
        """A new request was queued (a reservation policy records its sequences' reservations)."""

    def forget(self, seq_id: int) -> None:
        """The sequence has left the scheduler for good: free its blocks."""
        self.free(seq_id)

    def blocks_to_admit(self, seqs: Iterable[Sequence]) -> int:
        """The blocks these sequences need at least to run whole (their tokens so far)."""
        return sum(cdiv(seq.num_tokens, self.block_size) for seq in seqs)

    def can_admit(
        self, items: list[tuple[Sequence, int]], hits: Mapping[int, PrefixHit], reserve: int
    ) -> bool:
        """Whether allocating these chunks (after taking their hits) leaves at least `reserve` blocks free."""
        return self.num_free_gpu_blocks - self.blocks_needed(items, hits) >= reserve

    def take_copies(self) -> list[tuple[int, int]]:
        """Block copies queued outside allocation (a reservation policy's forks); none when paged."""
        return []

    def reservation_stats(self) -> tuple[int, int]:
        """(blocks reserved but in no block table, the largest free extent in blocks): paged, every free
        block serves any sequence, so (0, the free blocks)."""
        return 0, self.gpu_pool.num_free_blocks

    def snapshot(self, request_ids: Mapping[int, str]) -> CacheSnapshot:
        """Both pools' ref counts, cached blocks and holders, by request id (`request_ids`: seq id -> its
        request's id, for every sequence holding a block table). Reads only; call it between steps."""
        gpu: dict[int, tuple[str, ...]] = {}
        cpu: dict[int, tuple[str, ...]] = {}
        for seq_id, table in self._tables.items():
            holders = cpu if seq_id in self._on_cpu else gpu
            request_id = request_ids[seq_id]
            for block_id in _held(table):
                held = holders.get(block_id, ())
                # The sequences of one request share blocks (fork): name the request once.
                if request_id not in held:
                    holders[block_id] = (*held, request_id)
        return CacheSnapshot(self.block_size, self.gpu_pool.snapshot(gpu), self.cpu_pool.snapshot(cpu))

    # ---- allocation ----------------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Cover positions [0, num_computed + num_new); returns copy-on-write (src, dst) pairs, or None."""
        return self.allocate_group_slots([(seq, num_new_tokens)])

    def allocate_group_slots(self, items: list[tuple[Sequence, int]]) -> list[tuple[int, int]] | None:
        """allocate_slots for several sequences, all or nothing; None (and no change) if blocks run short."""
        if self.blocks_needed(items) > self.gpu_pool.num_free_blocks:
            return None
        copies: list[tuple[int, int]] = []
        for seq, num_new in items:
            assert seq.seq_id not in self._on_cpu, f"seq {seq.seq_id} is swapped out"
            table = self._tables.setdefault(seq.seq_id, [])
            first, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            for i in range(first // self.block_size, min(len(table), cdiv(end, self.block_size))):
                src = table[i]
                if self.gpu_pool.ref_count(src) > 1:
                    # Copy-on-write: the writer gets the copy; the other holders keep the original.
                    dst = self.gpu_pool.allocate()
                    self.gpu_pool.free(src)
                    table[i] = dst
                    copies.append((src, dst))
            while len(table) < cdiv(end, self.block_size):
                table.append(self.gpu_pool.allocate())
        return copies

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares every block of the parent (ref counts + 1); writes later copy on write."""
        assert child_seq_id not in self._tables, f"seq {child_seq_id} already has a block table"
        if parent_seq_id not in self._tables:
            return  # a parent without blocks (still waiting): nothing to share yet
        table = self._tables[parent_seq_id]
        pool = self.cpu_pool if parent_seq_id in self._on_cpu else self.gpu_pool
        for block_id in _held(table):
            pool.incref(block_id)
        self._tables[child_seq_id] = list(table)
        if parent_seq_id in self._on_cpu:
            self._on_cpu.add(child_seq_id)
        if parent_seq_id in self._block_hashes:
            self._block_hashes[child_seq_id] = list(self._block_hashes[parent_seq_id])

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks (no-op if it holds none)."""
        table = self._tables.pop(seq_id, None)
        self._block_hashes.pop(seq_id, None)
        self._waiting_hashes.pop(seq_id, None)
        pool = self.cpu_pool if seq_id in self._on_cpu else self.gpu_pool
        self._on_cpu.discard(seq_id)
        # Last block first: with prefix caching the tail of a chain is then evicted before its head.
        for block_id in reversed(_held(table or [])):
            pool.free(block_id)

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's computed tokens: those only rejected speculative tokens
        reached (the last of them first, each freed when no other table holds it). Full cached blocks hold
        computed, accepted tokens only, so none is ever trimmed."""
        table = self._tables.get(seq.seq_id)
        if not table or seq.seq_id in self._on_cpu:
            return
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        assert len(self._block_hashes.get(seq.seq_id, ())) <= keep, "trimming a cached block"
        while len(table) > keep:
            self.gpu_pool.free(table.pop())

    def free_out_of_window(self, seq: Sequence) -> None:
        """Under a sliding window, release the blocks whose positions all lie before the window of the
        sequence's next token (below num_computed_tokens - window + 1), leaving NULL_BLOCK in their entries.
        With prefix caching, only blocks already cached: the blocks after them chain to their hashes."""
        table = self._tables.get(seq.seq_id)
        if self.sliding_window is None or not table or seq.seq_id in self._on_cpu:
            return
        end = max(0, seq.num_computed_tokens - self.sliding_window + 1) // self.block_size
        if self.enable_prefix_caching:
            end = min(end, len(self._block_hashes.get(seq.seq_id, ())))
        for i in reversed(range(min(end, len(table)))):
            if table[i] == NULL_BLOCK:
                break
            self.gpu_pool.free(table[i])
            table[i] = NULL_BLOCK

    # ---- swapping ------------------------------------------------------------------------------------
    def _group_blocks(self, group: SequenceGroup) -> set[int]:
        return {b for s in group.unfinished_seqs() for b in _held(self._tables.get(s.seq_id, []))}

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the CPU pool has room for every distinct block of the group."""
        return len(self._group_blocks(group)) <= self.cpu_pool.num_free_blocks

    def can_swap_in(self, group: SequenceGroup, num_new_blocks: int = 0, use_watermark: bool = True) -> bool:
        """Whether the group's blocks plus num_new_blocks fit on the GPU (above the watermark by default)."""
        need = len(self._group_blocks(group)) + num_new_blocks
        return self.gpu_pool.num_free_blocks - need >= (self.watermark_blocks if use_watermark else 0)

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's blocks to the CPU pool; returns (gpu, cpu) copies, each shared block once."""
        return self._move(group, self.gpu_pool, self.cpu_pool, to_cpu=True)

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's blocks back to the GPU pool; returns (cpu, gpu) copies, each shared block once."""
        return self._move(group, self.cpu_pool, self.gpu_pool, to_cpu=False)

    def _move(
        self, group: SequenceGroup, src: BlockPool, dst: BlockPool, to_cpu: bool
    ) -> list[tuple[int, int]]:
        seqs = [s for s in group.unfinished_seqs() if s.seq_id in self._tables]
        assert all((s.seq_id in self._on_cpu) != to_cpu for s in seqs), "group is not where it should be"
        if len(self._group_blocks(group)) > dst.num_free_blocks:
            raise RuntimeError("not enough free blocks to swap: check can_swap_out / can_swap_in first")
        mapping: dict[int, int] = {}
        for seq in seqs:
            table = self._tables[seq.seq_id]
            new_table = [NULL_BLOCK] * (len(table) - len(_held(table)))
            for block_id in _held(table):
                if block_id in mapping:
                    dst.incref(mapping[block_id])
                else:
                    mapping[block_id] = dst.allocate()
                new_table.append(mapping[block_id])
            for block_id in reversed(_held(table)):
                src.free(block_id)
            self._tables[seq.seq_id] = new_table
            if to_cpu:
                self._on_cpu.add(seq.seq_id)
            else:
                self._on_cpu.discard(seq.seq_id)
                # The GPU copies are new blocks: let cache_block register them again if their hashes are free
                # (those of released blocks stay: the blocks after them chain to them).
                released = len(table) - len(_held(table))
                if seq.seq_id in self._block_hashes:
                    del self._block_hashes[seq.seq_id][released:]
        return list(mapping.items())

    # ---- prefix caching ------------------------------------------------------------------------------
    def lookup_prefix(self, seq: Sequence, read: bool = True) -> PrefixHit:
        """The cached full blocks a new sequence's tokens begin with; reads the pool only, takes nothing.
        `read=False`: no hit, for a sequence whose every prompt token must run (its prompt is scored); its
        blocks are still cached for others as it computes them."""
        if not self.enable_prefix_caching:
            return _NO_HIT
        if not read:
            return _NOT_READ
        assert seq.seq_id not in self._tables and seq.num_computed_tokens == 0, "not a new sequence"
        hashes = self._waiting_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        block_ids: list[int] = []
        pairs: list[tuple[BlockHash, int]] = []
        parent_id: int | None = None
        for i in range(self._num_prefix_candidates(seq)):
            token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            if i == len(hashes):
                hashes.append(self._hash_fn(hashes[-1] if hashes else None, token_ids))
            block_id = self.gpu_pool.lookup(hashes[i], parent_id, token_ids)
            if block_id is None:
                break
            parent_id = self.gpu_pool.content_id(block_id)
            block_ids.append(block_id)
            pairs.append((hashes[i], parent_id))
        return PrefixHit(tuple(block_ids), tuple(pairs), len(block_ids) * bs)

    def take_prefix(self, seq: Sequence, hit: PrefixHit) -> None:
        """Admit a new sequence with its hit (from lookup_prefix in this step): share the hit blocks as the start
        of its block table and count the prefix statistics; the caller sets num_computed_tokens = hit.num_tokens."""
        assert seq.seq_id not in self._tables and seq.num_computed_tokens == 0, "not a new sequence"
        self._waiting_hashes.pop(seq.seq_id, None)
        self._tables[seq.seq_id] = list(hit.block_ids)
        if not self.enable_prefix_caching:
            assert not hit.block_ids, "a prefix hit without prefix caching"
            return
        for block_id, (_, content_id) in zip(hit.block_ids, hit.block_hashes, strict=True):
            # Allocation since the lookup may have evicted and reused the block: a hit is good until then only.
            assert self.gpu_pool.content_id(block_id) == content_id, f"stale prefix hit on block {block_id}"
            self.gpu_pool.incref(block_id)
        self._block_hashes[seq.seq_id] = list(hit.block_hashes)
        if hit.queried:
            self.num_prefix_queried_blocks += self._num_prefix_candidates(seq)
            self.num_prefix_hit_blocks += len(hit.block_ids)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (benchmarks start cold this way); False, changing nothing, while any GPU block
        is held."""
        return self.gpu_pool.reset_cache()

    def _num_prefix_candidates(self, seq: Sequence) -> int:
        # Never the whole sequence: its last token must go through the model so that logits come out. And only
        # blocks whose tokens the host knows (none pending), so a memoized hash never covers a partial block.
        return min((seq.num_tokens - 1) // self.block_size, len(seq.token_ids) // self.block_size)

    def cache_block(self, seq: Sequence) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching or seq.seq_id in self._on_cpu:
            return
        bs = self.block_size
        table = self._tables.get(seq.seq_id, [])
        hashes = self._block_hashes.setdefault(seq.seq_id, [])
        # Only blocks whose tokens the host knows: a pending token's block is cached once it resolves.
        known = min(seq.num_computed_tokens, len(seq.token_ids))
        for i in range(len(hashes), min(known // bs, len(table))):
            parent_hash, parent_id = hashes[-1] if hashes else (None, None)
            token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block_hash = self._hash_fn(parent_hash, token_ids)
            content_id = self.gpu_pool.cache_block(table[i], block_hash, parent_id, token_ids)
            hashes.append((block_hash, content_id))

    # ---- invariants ----------------------------------------------------------------------------------
    def check_integrity(self, waiting_seq_ids: Collection[int] | None = None) -> None:
        """Raise AssertionError if ref counts, free lists or the prefix-cache map are inconsistent; given the
        ids of the sequences waiting for admission, also if a hash memo is kept for any other sequence."""
        gpu_refs: dict[int, int] = {}
        cpu_refs: dict[int, int] = {}
        for seq_id, table in self._tables.items():
            held = _held(table)
            assert len(set(held)) == len(held), f"seq {seq_id} holds a block twice"
            assert NULL_BLOCK not in held and (self.sliding_window or len(held) == len(table)), (
                f"seq {seq_id}: released entries past its first block, or without a window"
            )
            refs = cpu_refs if seq_id in self._on_cpu else gpu_refs
            for block_id in held:
                refs[block_id] = refs.get(block_id, 0) + 1
            hashes = self._block_hashes.get(seq_id, [])
            assert len(hashes) <= len(table), f"seq {seq_id} has hashes for blocks it does not hold"
        assert self._on_cpu <= self._tables.keys(), "swapped seq without a block table"
        assert self._block_hashes.keys() <= self._tables.keys(), "hashes kept for a freed seq"
        assert self._waiting_hashes.keys().isdisjoint(self._tables.keys()), (
            "hash memo kept for an admitted seq"
        )
        if waiting_seq_ids is not None:
            assert self._waiting_hashes.keys() <= set(waiting_seq_ids), "hash memo kept for a seq not waiting"
        self.gpu_pool.check_integrity(gpu_refs)
        self.cpu_pool.check_integrity(cpu_refs)
        for block in self.gpu_pool.blocks:
            if block.token_ids is not None:
                assert len(block.token_ids) == self.block_size, f"cached block {block.block_id} is not full"


def _held(table: list[int]) -> list[int]:
    """The blocks a table holds: its entries after the released (NULL_BLOCK) prefix."""
    i = 0
    while i < len(table) and table[i] == NULL_BLOCK:
        i += 1
    return table[i:]
