"""GET /kv-cache: the KV cache between two steps, in a compact JSON the playground page draws.

Each pool (`gpu`, and `cpu`: the swap pool) is one small int per physical block, in block id order,
run-length encoded as `runs = [code, count, code, count, ...]`:

    code = holder << 2 | shared << 1 | cached

`holder` is 1 + the index in `requests` of the block's holding request (the first one listed, when requests
share it through the prefix cache), 0 for a free block; `shared`: its ref count is above 1 (the samples or
beams of one request, or several requests); `cached`: the prefix-cache map holds it (a free cached block keeps
its content until it is evicted). A cache allocated front to back is a few runs, so tens of thousands of
blocks stay a small body. Only request ids and block counts leave the engine, never tokens or text.
"""

from __future__ import annotations

import itertools

import msgspec

from tinypaged.core.block_pool import PoolSnapshot
from tinypaged.engine.step.stats import EngineSnapshot


class RequestBlocks(msgspec.Struct):
    """A request holding blocks: its id and how many distinct blocks it holds in each pool."""

    id: str
    gpu_blocks: int
    cpu_blocks: int


class PoolView(msgspec.Struct):
    """One block pool: its size, counts and the run-length encoded code of every block."""

    num_blocks: int
    num_free: int  # ref count 0 (free cached blocks included: they are evicted on demand)
    num_shared: int  # ref count > 1
    num_cached: int  # in the prefix-cache map, held or free
    runs: list[int]


class KVCacheView(msgspec.Struct):
    """The body of GET /kv-cache."""

    block_size: int
    requests: list[RequestBlocks]  # the palette that block codes index (from 1)
    gpu: PoolView
    cpu: PoolView
    num_running: int
    num_waiting: int
    num_swapped: int
    gpu_cache_usage: float
    cpu_cache_usage: float
    num_preemptions: int
    num_steps: int


def kv_cache_view(snap: EngineSnapshot) -> KVCacheView:
    """The wire form of an engine snapshot; `requests` in order of their first block, GPU pool first."""
    palette: dict[str, RequestBlocks] = {}
    gpu = _pool_view(snap.cache.gpu, palette, on_cpu=False)
    cpu = _pool_view(snap.cache.cpu, palette, on_cpu=True)
    s = snap.stats
    return KVCacheView(
        block_size=snap.cache.block_size,
        requests=list(palette.values()),
        gpu=gpu,
        cpu=cpu,
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        num_swapped=s.num_swapped,
        gpu_cache_usage=s.gpu_cache_usage,
        cpu_cache_usage=s.cpu_cache_usage,
        num_preemptions=s.num_preemptions,
        num_steps=s.num_steps,
    )


def _pool_view(pool: PoolSnapshot, palette: dict[str, RequestBlocks], on_cpu: bool) -> PoolView:
    codes = [0] * len(pool.ref_counts)
    for block_id in pool.cached:
        codes[block_id] = 1
    index = {rid: i for i, rid in enumerate(palette, 1)}
    for block_id in sorted(pool.holders):
        holder = 0
        for rid in pool.holders[block_id]:
            entry = palette.get(rid)
            if entry is None:
                entry = palette[rid] = RequestBlocks(rid, 0, 0)
                index[rid] = len(palette)
            if on_cpu:
                entry.cpu_blocks += 1
            else:
                entry.gpu_blocks += 1
            holder = holder or index[rid]
        codes[block_id] |= holder << 2 | (pool.ref_counts[block_id] > 1) << 1
    runs: list[int] = []
    for code, run in itertools.groupby(codes):
        runs += (code, sum(1 for _ in run))
    return PoolView(
        num_blocks=len(codes),
        num_free=pool.ref_counts.count(0),
        num_shared=sum(1 for r in pool.ref_counts if r > 1),
        num_cached=len(pool.cached),
        runs=runs,
    )
