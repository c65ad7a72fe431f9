"""Physical KV blocks: reference counts, a free queue, and the prefix cache of full blocks, whose changes it
records as events (vLLM's KV events: a hash stored, removed, or every hash cleared) for a router to follow."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

BlockHash = bytes
HashFn = Callable[[BlockHash | None, tuple[int, ...]], BlockHash]


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
    """Chained hash of a full block: sha256 over the parent's hash and this block's token ids."""
    # sha256, not Python's hash(): hits are verified exactly anyway, but crafted collisions would let one
    # user keep another's prefix out of the cache.
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockEvent(NamedTuple):
    """One change to the prefix cache's map: a block hash `stored` (now findable) or `removed` (evicted), or the
    whole map `cleared` (block_hash None). Replaying a pool's events from its start gives its cached hashes."""

    kind: Literal["stored", "removed", "cleared"]
    block_hash: BlockHash | None


@dataclass(slots=True, eq=False)
class PhysicalBlock:
    """One physical KV block: how many block tables hold it, and its prefix-cache identity if any."""

    block_id: int
    ref_count: int = 0
    # New on every allocation: identifies this content even after the block id is reused.
    content_id: int = -1
    block_hash: BlockHash | None = None
    # The content_id of the block before this one when its K/V were computed (None: first block).
    parent_id: int | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """A block pool as it stood between two steps: each physical block's ref count, the blocks the prefix cache
    maps, and the requests whose block tables hold each held block. Ids and counts only, never tokens."""

    ref_counts: tuple[int, ...]  # per block id
    cached: frozenset[int]  # block ids in the prefix-cache map: held, or free until evicted
    holders: Mapping[int, tuple[str, ...]]  # held block id -> the request ids holding it, each once


class BlockPool:
    """A fixed set of physical blocks with ref counts, a free queue, and an optional prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [PhysicalBlock(i) for i in range(num_blocks)]
        # Free blocks, next to be handed out first. Uncached blocks sit at the front and cached ones at the
        # back in LRU order, so a cached block is only evicted when no plain free block is left.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._next_content_id = 0
        self.num_evictions = 0
        # Changes to the cache map since the last take_events(); the engine takes them every step, so at most a
        # step's worth wait here.
        self._events: list[BlockEvent] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, cached-but-unused ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently in the prefix-cache map (in use or free)."""
        return len(self._cached)

    def free_queue(self) -> tuple[int, ...]:
        """The free block ids in the order allocate() hands them out (cached ones last, least recent first)."""
        return tuple(self._free)

    def cached_hashes(self) -> frozenset[BlockHash]:
        """The block hashes the prefix cache maps now (held blocks and free ones not yet evicted)."""
        return frozenset(self._cached)

    def take_events(self) -> list[BlockEvent]:
        """The changes to the cache map since the last call, oldest first; the pool forgets them."""
        events, self._events = self._events, []
        return events

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold this block."""
        return self.blocks[block_id].ref_count

    def snapshot(self, holders: Mapping[int, tuple[str, ...]]) -> PoolSnapshot:
        """This pool's ref counts and cached blocks now, with `holders` (held block -> request ids)."""
        return PoolSnapshot(
            tuple(b.ref_count for b in self.blocks), frozenset(self._cached.values()), holders
        )

    def allocate(self) -> int:
        """Take a free block (evicting its cached content if it had any) with ref_count 1."""
        if not self._free:
            raise RuntimeError("out of free blocks: callers must check num_free_blocks first")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            # Lazy eviction: the content stayed findable until now, when the slot is needed.
            del self._cached[block.block_hash]
            self._events.append(BlockEvent("removed", block.block_hash))
            block.block_hash = block.parent_id = block.token_ids = None
            self.num_evictions += 1
        block.ref_count = 1
        block.content_id = self._next_content_id
        self._next_content_id += 1
        return block_id

    def reset_cache(self) -> bool:
        """Forget every cached block (as vLLM's reset_prefix_cache); only when no block is held, else False."""
        if len(self._free) != self.num_blocks:
            return False
        for block_id in self._cached.values():
            block = self.blocks[block_id]
            block.block_hash = block.parent_id = block.token_ids = None
        if self._cached:
            self._events.append(BlockEvent("cleared", None))
        self._cached.clear()
        return True

    def content_id(self, block_id: int) -> int:
        """The identity of the block's current content (changes whenever the block is reallocated)."""
        return self.blocks[block_id].content_id

    def incref(self, block_id: int) -> None:
        """One more table holds this block; a free cached block is taken back out of the free queue."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def free(self, block_id: int) -> None:
        """One table less holds this block; at zero it becomes free (cached content kept until evicted)."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)

    def lookup(self, block_hash: BlockHash, parent_id: int | None, token_ids: tuple[int, ...]) -> int | None:
        """The cached block holding exactly these tokens computed after parent content parent_id, or None."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        # A hash match is no proof: the tokens and the exact parent content must match too, so a collision
        # anywhere in the chain is a miss, never someone else's K/V.
        if block.token_ids != token_ids or block.parent_id != parent_id:
            return None
        return block_id

    def cache_block(
        self, block_id: int, block_hash: BlockHash, parent_id: int | None, token_ids: tuple[int, ...]
    ) -> int:
        """Register a full, computed block in the prefix cache; returns the content_id children chain to."""
        block = self.blocks[block_id]
        if not self.enable_caching or block.block_hash is not None:
            return block.content_id
        existing = self._cached.get(block_hash)
        if existing is not None:
            other = self.blocks[existing]
            # Same content computed twice (two requests admitted together): chain to the cached copy so
            # that this sequence's later blocks are findable. A collision: this block stays private.
            if other.token_ids == token_ids and other.parent_id == parent_id:
                return other.content_id
            return block.content_id
        block.block_hash, block.parent_id, block.token_ids = block_hash, parent_id, token_ids
        self._cached[block_hash] = block_id
        self._events.append(BlockEvent("stored", block_hash))
        return block.content_id

    def check_integrity(self, expected_refs: Mapping[int, int]) -> None:
        """Assert ref counts equal expected_refs (block -> holders), the free queue and cache map agree."""
        assert all(0 <= b < self.num_blocks for b in expected_refs), "table holds an unknown block id"
        for block in self.blocks:
            want = expected_refs.get(block.block_id, 0)
            assert block.ref_count == want, f"block {block.block_id}: ref_count {block.ref_count} != {want}"
            assert (block.ref_count == 0) == (block.block_id in self._free), (
                f"block {block.block_id} free state"
            )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, (
                    f"block {block.block_id} not mapped"
                )
                assert block.token_ids is not None
            else:
                assert block.parent_id is None and block.token_ids is None
        num_used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert len(self._free) + num_used == self.num_blocks, "free + used != total"
        assert all(0 <= b < self.num_blocks for b in self._free)
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, f"cache map entry for {block_id} is stale"
        assert self.enable_caching or not self._cached
