"""Scheduler: budgets, chunked prefill, watermark, preemption by recompute and swap, ignore, abort, fork."""

import dataclasses
import itertools

import pytest

from tinypaged.core.block_pool import BlockHash, HashFn, hash_block_tokens
from tinypaged.core.kv_cache_manager import KVCacheManager
from tinypaged.core.scheduler import Scheduler, SchedulerConfig
from tinypaged.core.sequence import Sequence, SequenceGroup, SequenceStatus

from .shadow import ShadowCache, manager_state, run_step

_ids = itertools.count()


def make(
    num_gpu: int = 8,
    num_cpu: int = 8,
    bs: int = 4,
    max_num_seqs: int = 8,
    budget: int = 64,
    max_model_len: int = 64,
    mode: str | None = None,
    chunked: bool = True,
    caching: bool = False,
    watermark: float = 0.0,
    hash_fn: HashFn = hash_block_tokens,
) -> tuple[Scheduler, ShadowCache]:
    kv = KVCacheManager(
        bs, num_gpu, num_cpu, watermark=watermark, enable_prefix_caching=caching, hash_fn=hash_fn
    )
    cfg = SchedulerConfig(max_num_seqs, budget, max_model_len, mode, chunked)  # type: ignore[arg-type]
    return Scheduler(cfg, kv), ShadowCache(bs)


def add(sched: Scheduler, rid: str, tokens: int | list[int], arrival: float) -> Sequence:
    token_ids = list(range(100, 100 + tokens)) if isinstance(tokens, int) else tokens
    seq = Sequence(next(_ids), token_ids)
    sched.add_seq_group(SequenceGroup(rid, [seq], arrival))
    return seq


def shape(out) -> list[tuple[str, int, int, bool]]:  # type: ignore[no-untyped-def]
    return [(s.request_id, s.num_computed_tokens, s.num_new_tokens, s.do_sample) for s in out.scheduled]


def assert_all_free(sched: Scheduler) -> None:
    assert not sched.has_unfinished()
    assert sched.kv.num_free_gpu_blocks == sched.kv.num_gpu_blocks
    assert sched.kv.num_free_cpu_blocks == sched.kv.num_cpu_blocks
    sched.kv.check_integrity()


def test_prefill_then_decode_then_finish_frees_blocks() -> None:
    sched, shadow = make()
    seq = add(sched, "a", 10, 0)
    assert shape(run_step(sched, shadow)) == [("a", 0, 10, True)]
    assert shape(run_step(sched, shadow)) == [("a", 10, 1, True)]
    assert seq.output_token_ids == [7, 7] and sched.num_running == 1
    sched.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
    assert seq.status == SequenceStatus.FINISHED_STOPPED
    assert_all_free(sched)


def test_chunked_prefill_samples_only_on_the_last_chunk() -> None:
    sched, shadow = make(budget=4)
    add(sched, "a", 10, 0)
    add(sched, "b", 3, 1)
    assert shape(run_step(sched, shadow)) == [("a", 0, 4, False)]
    assert shape(run_step(sched, shadow)) == [("a", 4, 4, False)]
    assert shape(run_step(sched, shadow)) == [("a", 8, 2, True), ("b", 0, 2, False)]
    assert shape(run_step(sched, shadow)) == [("a", 10, 1, True), ("b", 2, 1, True)]


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    sched, shadow = make(budget=8, max_model_len=8, chunked=False)
    add(sched, "a", 6, 0)
    add(sched, "b", 8, 1)
    assert shape(run_step(sched, shadow)) == [("a", 0, 6, True)]
    assert shape(run_step(sched, shadow)) == [("a", 6, 1, True)]  # b would need 8 of the 7 left: waits
    sched.abort_seq_group("a")
    assert shape(run_step(sched, shadow)) == [("b", 0, 8, True)]


def test_max_num_seqs_and_token_budget() -> None:
    sched, shadow = make(max_num_seqs=2, num_gpu=16)
    for i in range(4):
        add(sched, f"r{i}", 2, i)
    assert [s[0] for s in shape(run_step(sched, shadow))] == ["r0", "r1"]
    assert [s[0] for s in shape(run_step(sched, shadow))] == ["r0", "r1"]
    assert sched.num_waiting == 2
    sched2, shadow2 = make(budget=5, num_gpu=16)
    for i in range(3):
        add(sched2, f"r{i}", 2, i)
    assert shape(run_step(sched2, shadow2)) == [("r0", 0, 2, True), ("r1", 0, 2, True), ("r2", 0, 1, False)]


def test_watermark_holds_back_admission_only_while_something_runs() -> None:
    sched, shadow = make(num_gpu=10, watermark=0.2)  # 2 blocks in reserve
    add(sched, "a", 16, 0)  # 4 blocks
    add(sched, "b", 16, 1)  # 4 more: leaves exactly 2
    add(sched, "c", 4, 2)  # 1 more would dip below the watermark
    assert [s[0] for s in shape(run_step(sched, shadow))] == ["a", "b"]
    assert sched.num_waiting == 1
    # Alone, a request may use the reserve: the watermark is there for running sequences to grow.
    sched2, shadow2 = make(num_gpu=4, watermark=0.25)
    add(sched2, "big", 16, 0)
    assert shape(run_step(sched2, shadow2)) == [("big", 0, 16, True)]


def test_prompts_that_can_never_fit_are_ignored_without_stalling() -> None:
    sched, shadow = make(num_gpu=4, max_model_len=32)
    too_long = add(sched, "long", 33, 0)
    too_big = add(sched, "big", 17, 1)  # 5 blocks of 4 > 4 blocks in the cache
    add(sched, "ok", 3, 2)
    out = run_step(sched, shadow)
    assert shape(out) == [("ok", 0, 3, True)]
    reasons = dict(out.ignored)
    assert "max_model_len" in reasons["long"] and "KV cache blocks" in reasons["big"]
    assert too_long.status == too_big.status == SequenceStatus.FINISHED_IGNORED
    assert sched.get_seq_group("long") is None and sched.num_ignored == 2


def test_a_sequence_that_outgrows_the_whole_cache_is_finished() -> None:
    sched, shadow = make(num_gpu=2)
    seq = add(sched, "a", 8, 0)
    run_step(sched, shadow)
    out = run_step(sched, shadow)  # the sampled token needs a third block: there is none, ever
    assert out.scheduled == () and out.ignored[0][0] == "a"
    assert seq.status == SequenceStatus.FINISHED_IGNORED and seq.output_token_ids == [7]
    assert_all_free(sched)


def fill_two(mode: str | None, **kw: object) -> tuple[Scheduler, ShadowCache, Sequence, Sequence]:
    """a and b each hold 2 of 4 blocks after 2 steps; the third step's decode needs a fifth block."""
    sched, shadow = make(num_gpu=4, mode=mode, **kw)  # type: ignore[arg-type]
    a, b = add(sched, "a", 7, 0), add(sched, "b", 7, 1)
    run_step(sched, shadow)
    run_step(sched, shadow)
    assert a.num_tokens == b.num_tokens == 9 and sched.kv.num_free_gpu_blocks == 0
    return sched, shadow, a, b


def test_preempt_by_recompute_keeps_outputs_and_recomputes_them() -> None:
    sched, shadow, a, b = fill_two("recompute")
    out = run_step(sched, shadow)
    assert out.preempted == ("b",) and shape(out) == [("a", 8, 1, True)]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [7, 7] and sched.waiting[0].request_id == "b"
    assert sched.num_preemptions == 1 and sched.kv.get_block_table(b.seq_id) == []
    sched.finish_seq(a, SequenceStatus.FINISHED_LENGTH)
    sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=5)
    # b recomputes prompt + outputs in chunks of the budget and samples only at the end.
    assert shape(run_step(sched, shadow)) == [("b", 0, 5, False)]
    assert shape(run_step(sched, shadow)) == [("b", 5, 4, True)]
    assert b.output_token_ids == [7, 7, 7]
    sched.abort_seq_group("b")
    assert_all_free(sched)


def test_preempt_by_swap_then_swap_in_before_new_requests() -> None:
    sched, shadow, a, b = fill_two("swap")
    out = run_step(sched, shadow)
    assert out.preempted == ("b",) and len(out.blocks_to_swap_out) == 2
    assert b.status == SequenceStatus.SWAPPED and sched.num_swapped == 1
    c = add(sched, "c", 4, 2)
    out = run_step(sched, shadow)
    assert [s.request_id for s in out.scheduled] == ["a"]  # b must not run while swapped; c must wait
    assert c.status == SequenceStatus.WAITING
    sched.finish_seq(a, SequenceStatus.FINISHED_STOPPED)
    out = run_step(sched, shadow)
    assert len(out.blocks_to_swap_in) == 2 and shape(out)[0] == ("b", 8, 1, True)
    assert b.status == SequenceStatus.RUNNING and sched.num_swapped == 0


def test_swapped_group_blocks_admission_until_it_is_back() -> None:
    sched, shadow, a, b = fill_two("swap")
    run_step(sched, shadow)
    add(sched, "c", 1, 2)
    for _ in range(3):
        out = run_step(sched, shadow)
        assert out.blocks_to_swap_in == () and [s.request_id for s in out.scheduled] == ["a"]


def test_no_swap_in_in_a_step_that_preempted() -> None:
    sched, shadow = make(num_gpu=5, mode="swap")
    a = add(sched, "a", 7, 0)
    add(sched, "b", 7, 1)
    run_step(sched, shadow)
    run_step(sched, shadow)
    out = run_step(sched, shadow)  # a needs block 5: b is swapped out
    assert out.preempted == ("b",)
    c = add(sched, "c", 3, 2)
    sched.finish_seq(a, SequenceStatus.FINISHED_STOPPED)
    out = run_step(sched, shadow)
    assert out.blocks_to_swap_in and c.status == SequenceStatus.RUNNING  # b came back first, then c


def test_default_mode_swaps_groups_with_several_sequences() -> None:
    sched, shadow = make(num_gpu=5)
    a = add(sched, "a", 7, 0)
    b = add(sched, "b", 7, 1)
    run_step(sched, shadow)
    child = b.fork(next(_ids))
    sched.fork_seq(b, child)
    run_step(sched, shadow)  # b's two sequences copy-on-write their partial block
    out = run_step(sched, shadow)
    assert out.preempted == ("b",) and out.blocks_to_swap_out
    assert {s.status for s in (b, child)} == {SequenceStatus.SWAPPED}
    sched.finish_seq(a, SequenceStatus.FINISHED_STOPPED)
    out = run_step(sched, shadow)
    assert {s.seq_id for s in out.scheduled} == {b.seq_id, child.seq_id}
    sched.abort_seq_group("b")
    assert_all_free(sched)


def test_default_mode_recomputes_single_sequence_groups() -> None:
    sched, shadow, a, b = fill_two(None)
    out = run_step(sched, shadow)
    assert out.preempted == ("b",) and out.blocks_to_swap_out == ()
    assert b.status == SequenceStatus.WAITING


def test_swap_falls_back_to_recompute_without_cpu_room() -> None:
    sched, shadow, a, b = fill_two("swap", num_cpu=1)
    out = run_step(sched, shadow)
    assert out.preempted == ("b",) and out.blocks_to_swap_out == () and b.status == SequenceStatus.WAITING


def test_latest_arrivals_are_preempted_first_and_requeued_in_arrival_order() -> None:
    sched, shadow = make(num_gpu=6, mode="recompute")
    add(sched, "a", 11, 0)
    for t, name in enumerate("bcd", start=1):
        add(sched, name, 3, t)
    run_step(sched, shadow)
    run_step(sched, shadow)
    add(sched, "e", 3, 10)
    # Every sequence now needs a new block and none is free: d goes for a, then c for b.
    out = run_step(sched, shadow)
    assert out.preempted == ("d", "c") and [s.request_id for s in out.scheduled] == ["a", "b"]
    assert [g.request_id for g in sched.waiting] == ["c", "d", "e"]
    assert sched.num_preemptions == 2


@pytest.mark.parametrize("where", ["waiting", "running", "swapped"])
def test_abort_frees_everything(where: str) -> None:
    sched, shadow, a, b = fill_two("swap")
    if where == "swapped":
        run_step(sched, shadow)
        assert b.status == SequenceStatus.SWAPPED
    waiting = add(sched, "w", 5, 5)
    victim = {"waiting": waiting, "running": b, "swapped": b}[where]
    rid = "w" if where == "waiting" else "b"
    assert sched.abort_seq_group(rid)
    assert victim.status == SequenceStatus.FINISHED_ABORTED
    assert not sched.abort_seq_group(rid)
    sched.kv.check_integrity()
    for rid in ("a", "b", "w"):
        sched.abort_seq_group(rid)
    assert_all_free(sched)


def forked() -> tuple[Scheduler, ShadowCache, Sequence, Sequence]:
    """A 6-token prompt computed, then forked: parent and child share both its blocks."""
    sched, shadow = make()
    parent = add(sched, "p", 6, 0)
    run_step(sched, shadow)
    child = parent.fork(next(_ids))
    sched.fork_seq(parent, child)
    return sched, shadow, parent, child


def test_fork_shares_blocks_and_the_copy_goes_to_the_writer() -> None:
    sched, shadow, parent, child = forked()
    assert sched.kv.get_block_table(child.seq_id) == sched.kv.get_block_table(parent.seq_id)
    child.token_ids[-1] = 8  # the child sampled another token
    out = run_step(sched, shadow)  # run_step checks each sequence reads its own prefix
    # The first writer (the parent, scheduled first) gets the copy; the child then writes in place.
    assert len(out.blocks_to_copy) == 1
    src, dst = out.blocks_to_copy[0]
    assert (
        sched.kv.get_block_table(parent.seq_id)[1] == dst and sched.kv.get_block_table(child.seq_id)[1] == src
    )
    assert sched.kv.get_block_table(parent.seq_id)[0] == sched.kv.get_block_table(child.seq_id)[0]
    sched.finish_seq(parent, SequenceStatus.FINISHED_STOPPED)
    assert sched.has_unfinished()
    sched.finish_seq(child, SequenceStatus.FINISHED_STOPPED)
    assert_all_free(sched)


def test_drop_seq_frees_its_blocks_and_leaves_the_group() -> None:
    sched, shadow, parent, child = forked()
    free_before_copy = sched.kv.num_free_gpu_blocks
    run_step(sched, shadow)  # both write their next token: the shared last block is copied for one of them
    sched.drop_seq(child)
    group = sched.get_seq_group("p")
    assert group is not None and group.seqs == [parent] and sched.get_seq(child.seq_id) is None
    assert child.status == SequenceStatus.FINISHED_ABORTED
    assert sched.kv.num_free_gpu_blocks == free_before_copy  # the copy went back
    sched.kv.check_integrity()
    out = run_step(sched, shadow)
    assert [s.seq_id for s in out.scheduled] == [parent.seq_id]
    sched.finish_seq(parent, SequenceStatus.FINISHED_STOPPED)
    assert_all_free(sched)


def test_prefix_caching_skips_computed_blocks() -> None:
    sched, shadow = make(caching=True)
    first = add(sched, "a", list(range(10)), 0)
    run_step(sched, shadow)
    sched.finish_seq(first, SequenceStatus.FINISHED_STOPPED)
    add(sched, "b", list(range(10)) + [42], 1)
    assert shape(run_step(sched, shadow)) == [("b", 8, 3, True)]


def test_blocked_request_leaves_the_cache_alone_and_hashes_its_prompt_once() -> None:
    calls: list[tuple[int, ...]] = []

    def counting_hash(parent: BlockHash | None, tokens: tuple[int, ...]) -> BlockHash:
        calls.append(tokens)
        return hash_block_tokens(parent, tokens)

    sched, shadow = make(num_gpu=8, bs=16, budget=128, max_model_len=128, caching=True, hash_fn=counting_hash)
    kv = sched.kv
    a = add(sched, "a", list(range(32)), 0)
    run_step(sched, shadow)
    a_blocks = kv.get_block_table(a.seq_id)
    sched.finish_seq(a, SequenceStatus.FINISHED_STOPPED)  # its two full blocks stay cached, free
    hog = add(sched, "hog", [1000 + i for i in range(81)], 1)  # 6 blocks; decodes 15 tokens in its last one
    run_step(sched, shadow)
    assert kv.num_free_gpu_blocks == 2 and set(kv.gpu_pool.free_queue()) == set(a_blocks)
    # b hits a's two free blocks; taking them and the 2 new blocks past them needs 4 of the 2 free.
    b = add(sched, "b", list(range(32)) + [200 + i for i in range(20)], 2)
    seq_ids = [a.seq_id, hog.seq_id, b.seq_id]
    counters = (kv.num_prefix_queried_blocks, kv.num_prefix_hit_blocks)
    calls.clear()
    for step in range(10):
        before = manager_state(kv, seq_ids)
        out = run_step(sched, shadow)
        assert [s.request_id for s in out.scheduled] == ["hog"]
        assert manager_state(kv, seq_ids) == before, f"step {step} changed the KV cache manager"
        assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
        # The first lookup hashes b's blocks up to its first miss; later steps reuse the memo.
        assert len(calls) == 3, f"step {step}: {len(calls)} hashes"
    sched.finish_seq(hog, SequenceStatus.FINISHED_STOPPED)
    assert shape(run_step(sched, shadow)) == [("b", 32, 20, True)]  # run_step checks b reads a's K/V
    assert kv.get_block_table(b.seq_id)[:2] == a_blocks
    # Queried: (52 - 1) // 16 = 3 candidate blocks, 2 of them hit; once, not once per blocked step.
    assert (kv.num_prefix_queried_blocks, kv.num_prefix_hit_blocks) == (counters[0] + 3, counters[1] + 2)


@pytest.mark.parametrize("num_seqs", [1, 2], ids=["one_seq", "group_of_two"])
@pytest.mark.parametrize("spare", [0, -1], ids=["exactly_enough", "one_short"])
def test_admission_counts_free_cached_hit_blocks(num_seqs: int, spare: int) -> None:
    """Hit blocks that are free (ref count 0, cached) leave the free queue when taken: they count as needed
    blocks, once for a group whose sequences share them. Exactly enough free blocks admit; one fewer refuse."""
    sched, shadow = make(num_gpu=10, caching=True)
    kv = sched.kv
    a = add(sched, "a", list(range(9)), 0)
    run_step(sched, shadow)
    a_blocks = kv.get_block_table(a.seq_id)
    sched.finish_seq(a, SequenceStatus.FINISHED_STOPPED)  # blocks [0:4] and [4:8] cached, free
    # Each sequence: the 2 free hit blocks (shared by the group) and 2 new blocks for its last 5 tokens.
    need = 2 + 2 * num_seqs
    hog_blocks = kv.num_gpu_blocks - need - spare
    hog = add(sched, "hog", [1000 + i for i in range(4 * hog_blocks - 3)], 1)  # decodes inside its last block
    run_step(sched, shadow)
    assert kv.num_free_gpu_blocks == need + spare
    seqs = [
        Sequence(next(_ids), list(range(8)) + [50 + 10 * i + j for j in range(5)]) for i in range(num_seqs)
    ]
    sched.add_seq_group(SequenceGroup("g", seqs, 2))
    before = manager_state(kv, [a.seq_id, hog.seq_id] + [s.seq_id for s in seqs])
    out = run_step(sched, shadow)
    if spare < 0:
        assert shape(out) == [("hog", 4 * hog_blocks - 3, 1, True)]
        assert manager_state(kv, [a.seq_id, hog.seq_id] + [s.seq_id for s in seqs]) == before
        assert all(s.status == SequenceStatus.WAITING for s in seqs)
        return
    assert shape(out) == [("hog", 4 * hog_blocks - 3, 1, True)] + [("g", 8, 5, True)] * num_seqs
    assert kv.num_free_gpu_blocks == 0
    assert all(kv.get_block_table(s.seq_id)[:2] == a_blocks[:2] for s in seqs)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(0, 8, 8)
    with pytest.raises(ValueError):
        SchedulerConfig(1, 8, 8, "drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Sequence(999, [])
    sched, _ = make()
    seq = add(sched, "x", 3, 0)
    with pytest.raises(ValueError):
        sched.add_seq_group(SequenceGroup("x", [Sequence(1000, [1])], 0))
    with pytest.raises(ValueError):
        sched.add_seq_group(SequenceGroup("y", [seq], 0))
    with pytest.raises(ValueError):
        sched.finish_seq(seq, SequenceStatus.RUNNING)
