"""Speculative decoding's KV bookkeeping, property-tested: proposed tokens are scheduled with a decode, their
slots written, and the rejected ones rolled back (`Scheduler.rollback`), among forks (n > 1, copy-on-write),
prefix caching, preemption by recompute and by swap. After every step the manager's invariants hold, every
sequence's computed positions hold exactly its accepted prefix (the shadow cache), no block outlives the
positions its sequence computed, and every cached full block holds the K/V of exactly its own tokens."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinypaged.core.kv_cache_manager import KVCacheManager
from tinypaged.core.scheduler import Scheduler, SchedulerConfig
from tinypaged.core.sequence import Sequence, SequenceGroup, SequenceStatus

from .shadow import ShadowCache

BS = 2


def _spec_step(sched: Scheduler, shadow: ShadowCache, rng: random.Random, max_k: int) -> None:
    """Propose, schedule, write, verify (a random number accepted), roll back, append."""
    kv = sched.kv
    for group in sched.running:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            if seq.num_tokens - seq.num_computed_tokens == 1:
                seq.spec_token_ids = tuple(rng.randrange(4) for _ in range(rng.randint(0, max_k)))
    out = sched.schedule()
    for group in sched.running + sched.waiting + sched.swapped:
        for seq in group.seqs:
            seq.spec_token_ids = ()
    shadow.apply(out)
    proposed: dict[int, tuple[int, ...]] = {}
    for s in out.scheduled:
        seq = sched.get_seq(s.seq_id)
        assert seq is not None
        shadow.check_prefix(s.block_table, seq.token_ids, s.num_computed_tokens)
        spec = s.token_ids[len(s.token_ids) - s.num_spec_tokens :] if s.num_spec_tokens else ()
        assert not spec or s.do_sample
        shadow.write(s.block_table, seq.token_ids + list(spec), s.num_computed_tokens, s.num_new_tokens)
        proposed[s.seq_id] = spec
    sched.update_from_output(out)
    for s in out.scheduled:
        seq = sched.get_seq(s.seq_id)
        if seq is None or not s.do_sample:
            continue
        spec = proposed[s.seq_id]
        accepted = rng.randint(0, len(spec))
        sched.rollback(seq, len(spec) - accepted)
        for token in (*spec[:accepted], rng.randrange(4)):
            seq.append_token(token)
        assert seq.num_tokens - seq.num_computed_tokens == 1
        # n > 1: the first sample forks a sibling that shares every block.
        group = sched.get_seq_group(s.request_id)
        if group is not None and len(group.seqs) == 1 and group.request_id.endswith("n2"):
            child = seq.fork(10_000 + seq.seq_id)
            sched.fork_seq(seq, child)
        if len(seq.token_ids) >= seq.prompt_len + 12:
            sched.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
    _check(sched, kv, shadow)


def _check(sched: Scheduler, kv: KVCacheManager, shadow: ShadowCache) -> None:
    kv.check_integrity(waiting_seq_ids=[s.seq_id for g in sched.waiting for s in g.seqs])
    for group in sched.running + sched.swapped:
        for seq in group.unfinished_seqs():
            shadow.check_seq(kv, seq)
            table = kv.get_block_table(seq.seq_id)
            # Nothing past the computed tokens is held: rejected positions' blocks went back.
            assert len(table) == -(-seq.num_computed_tokens // BS), (seq, table)
    for block in kv.gpu_pool.blocks:
        if block.token_ids is not None:  # cached: its K/V is that of exactly its tokens
            for offset in range(BS):
                slot = shadow.gpu.get((block.block_id, offset))
                assert slot is not None and slot[-(offset + 1) :] == block.token_ids[: offset + 1], block


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(["recompute", "swap"]))
def test_rollback_keeps_blocks_and_cache_right(seed: int, mode: str) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(BS, 14, 10, watermark=0.0, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(4, 12, 64, preemption_mode=mode), kv)  # type: ignore[arg-type]
    shadow = ShadowCache(BS)
    next_id = 0
    for i in range(rng.randint(2, 5)):
        # Prompts from a tiny vocabulary, some repeated: prefix-cache hits, and blocks filled by accepted
        # proposals that other sequences then find in the cache.
        prompt = [rng.randrange(4) for _ in range(rng.randint(1, 7))]
        seqs = [Sequence(next_id, prompt)]
        next_id += 1
        name = f"r{i}" + ("n2" if rng.random() < 0.4 else "")
        sched.add_seq_group(SequenceGroup(name, seqs, arrival_time=float(i)))
    for _ in range(40):
        if not sched.has_unfinished():
            break
        _spec_step(sched, shadow, rng, max_k=4)
    assert all(b.ref_count >= 0 for b in kv.gpu_pool.blocks)


def test_rollback_frees_a_block_only_rejected_tokens_reached() -> None:
    kv = KVCacheManager(BS, 8, 0, watermark=0.0)
    sched = Scheduler(SchedulerConfig(2, 16, 64), kv)
    seq = Sequence(0, [1, 2, 3])
    sched.add_seq_group(SequenceGroup("r", [seq], arrival_time=0.0))
    out = sched.schedule()
    sched.update_from_output(out)
    seq.append_token(4)  # 4 tokens, 3 computed: the table holds 2 blocks
    seq.spec_token_ids = (5, 6, 7)
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.num_new_tokens, s.num_spec_tokens, s.token_ids, s.do_sample) == (4, 3, (4, 5, 6, 7), True)
    assert len(s.block_table) == 4  # positions 0..6
    free_before = kv.num_free_gpu_blocks
    sched.update_from_output(out)
    sched.rollback(seq, 3)  # all three rejected: computed ends after token 4 (position 3)
    assert seq.num_computed_tokens == 4 and len(kv.get_block_table(0)) == 2
    assert kv.num_free_gpu_blocks == free_before + 2
    kv.check_integrity()
