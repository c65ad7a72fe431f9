"""Property tests: random operation sequences against the KV cache manager and the scheduler.

A shadow cache plays the model runner: each slot records the exact prefix its K/V would depend on, so a
wrong copy-on-write, swap mapping or prefix-cache hit shows up as a sequence reading someone else's K/V.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tinypaged.core.kv_cache_manager import KVCacheManager, PrefixHit
from tinypaged.core.reservation import ReservingKVCacheManager
from tinypaged.core.scheduler import Scheduler, SchedulerConfig
from tinypaged.core.sequence import Sequence, SequenceGroup, SequenceStatus

from .shadow import ShadowCache, check_snapshot, manager_state, run_step

BS = 2
SMALL = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)


class ManagerMachine(RuleBasedStateMachine):
    """Prefix lookups and admission, allocate, append, fork, copy-on-write, free, swap out and in, evictions."""

    hash_fn = None  # subclasses force collisions

    def __init__(self) -> None:
        super().__init__()
        kw = {} if self.hash_fn is None else {"hash_fn": self.hash_fn}
        self.kv = KVCacheManager(BS, 10, 6, watermark=0.0, enable_prefix_caching=True, **kw)
        self.shadow = ShadowCache(BS)
        self.groups: dict[int, SequenceGroup] = {}  # admitted: they hold block tables
        self.waiting: dict[int, list[Sequence]] = {}  # not admitted yet: only looked up
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _pick(self, data: st.DataObject, on_cpu: bool) -> SequenceGroup | None:
        groups = [g for g in self.groups.values() if self.kv.is_swapped(g.seqs[0].seq_id) == on_cpu]
        return data.draw(st.sampled_from(groups)) if groups else None

    def _state(self) -> object:
        seq_ids = [s.seq_id for g in self.groups.values() for s in g.seqs]
        return manager_state(self.kv, seq_ids + [s.seq_id for seqs in self.waiting.values() for s in seqs])

    def _lookup(self, seq: Sequence) -> PrefixHit:
        """lookup_prefix, checked: it changes nothing, and the hit blocks hold exactly this prefix's K/V."""
        before = self._state()
        hit = self.kv.lookup_prefix(seq)
        assert self._state() == before, "lookup_prefix changed the manager"
        assert hit.num_tokens == len(hit.block_ids) * BS < seq.num_tokens
        assert len(hit.block_hashes) == len(hit.block_ids)
        self.shadow.check_prefix(hit.block_ids, seq.token_ids, hit.num_tokens)
        return hit

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=9), data=st.data())
    def add_group(self, prompt: list[int], data: st.DataObject) -> None:
        # Several sequences sharing a prompt: a group preempted by recompute after forking (n > 1).
        tails = data.draw(st.lists(st.lists(st.integers(0, 2), max_size=3), min_size=1, max_size=3))
        seqs = [Sequence(self._new_id(), prompt + tail) for tail in tails]
        self.waiting[seqs[0].seq_id] = seqs

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        for seq in self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))]:
            self._lookup(seq)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def grow_waiting(self, data: st.DataObject) -> None:
        # A waiting sequence's tokens only grow by appends (a recompute's pending token resolving).
        seqs = self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))]
        data.draw(st.sampled_from(seqs)).append_token(data.draw(st.integers(0, 2)))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def drop_waiting(self, data: st.DataObject) -> None:
        for seq in self.waiting.pop(data.draw(st.sampled_from(sorted(self.waiting)))):
            self.kv.free(seq.seq_id)  # aborted before admission

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.waiting)))
        seqs = self.waiting[key]
        hits = {seq.seq_id: self._lookup(seq) for seq in seqs}
        # A chunk for the first k sequences (a budget may cut the rest); every sequence takes its hit.
        k = data.draw(st.integers(1, len(seqs)))
        items = [
            (seq, data.draw(st.integers(1, seq.num_tokens - hits[seq.seq_id].num_tokens))) for seq in seqs[:k]
        ]
        need = self.kv.blocks_needed(items, hits)
        free = self.kv.num_free_gpu_blocks
        if need > free:
            return
        counters = (self.kv.num_prefix_queried_blocks, self.kv.num_prefix_hit_blocks)
        for seq in seqs:
            self.kv.take_prefix(seq, hits[seq.seq_id])
            seq.num_computed_tokens = hits[seq.seq_id].num_tokens
        assert self.kv.allocate_group_slots(items) == []  # nothing to copy on write past a hit
        assert self.kv.num_free_gpu_blocks == free - need, "blocks_needed with hits is not exact"
        # The statistics count each admitted sequence once: every full block short of its last token queried.
        assert self.kv.num_prefix_queried_blocks == counters[0] + sum((s.num_tokens - 1) // BS for s in seqs)
        assert self.kv.num_prefix_hit_blocks == counters[1] + sum(len(h.block_ids) for h in hits.values())
        for seq, n in items:
            self.shadow.write(self.kv.get_block_table(seq.seq_id), seq.token_ids, seq.num_computed_tokens, n)
            seq.num_computed_tokens += n
            self.kv.cache_block(seq)
        del self.waiting[key]
        self.groups[key] = SequenceGroup(str(key), seqs, 0.0)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        group = self._pick(data, on_cpu=False)
        if group is None:
            return
        seq = data.draw(st.sampled_from(group.seqs))
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(data.draw(st.integers(0, 2)))
        n = data.draw(st.integers(1, seq.num_tokens - seq.num_computed_tokens))
        before = self.kv.get_block_table(seq.seq_id)
        need = self.kv.blocks_needed([(seq, n)])
        copies = self.kv.allocate_slots(seq, n)
        if copies is None:
            assert need > self.kv.num_free_gpu_blocks and self.kv.get_block_table(seq.seq_id) == before
            return
        self.shadow.copy(copies)
        self.shadow.write(self.kv.get_block_table(seq.seq_id), seq.token_ids, seq.num_computed_tokens, n)
        seq.num_computed_tokens += n
        self.kv.cache_block(seq)

    @precondition(lambda self: self.groups)
    @rule(data=st.data(), on_cpu=st.booleans())
    def fork(self, data: st.DataObject, on_cpu: bool) -> None:
        group = self._pick(data, on_cpu)
        if group is None:
            return
        parent = data.draw(st.sampled_from(group.seqs))
        child = parent.fork(self._new_id())
        self.kv.fork(parent.seq_id, child.seq_id)
        group.seqs.append(child)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.groups)))
        group = self.groups[key]
        seq = data.draw(st.sampled_from(group.seqs))
        self.kv.free(seq.seq_id)
        group.seqs.remove(seq)
        if not group.seqs:
            del self.groups[key]

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        group = self._pick(data, on_cpu=False)
        if group is None or not self.kv.can_swap_out(group):
            return
        pairs = self.kv.swap_out(group)
        assert len({g for g, _ in pairs}) == len({c for _, c in pairs}) == len(pairs)
        self.shadow.swap_out(pairs)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        group = self._pick(data, on_cpu=True)
        if group is None or not self.kv.can_swap_in(group):
            return
        self.shadow.swap_in(self.kv.swap_in(group))

    @invariant()
    def consistent(self) -> None:
        self.kv.check_integrity(waiting_seq_ids=[s.seq_id for seqs in self.waiting.values() for s in seqs])
        for group in self.groups.values():
            for seq in group.seqs:
                self.shadow.check_seq(self.kv, seq)
        request_ids = {s.seq_id: g.request_id for g in self.groups.values() for s in g.seqs}
        check_snapshot(self.kv, self.kv.snapshot(request_ids), request_ids)

    def teardown(self) -> None:
        for group in self.groups.values():
            for seq in group.seqs:
                self.kv.free(seq.seq_id)
        for seqs in self.waiting.values():
            for seq in seqs:
                self.kv.free(seq.seq_id)
        self.kv.check_integrity(waiting_seq_ids=())
        assert self.kv.num_free_gpu_blocks == self.kv.num_gpu_blocks
        assert self.kv.num_free_cpu_blocks == self.kv.num_cpu_blocks


class CollidingManagerMachine(ManagerMachine):
    """Only a handful of hash values, parent ignored: every hit must be earned by exact comparison."""

    @staticmethod
    def hash_fn(parent: bytes | None, tokens: tuple[int, ...]) -> bytes:  # type: ignore[override]
        return bytes([sum(tokens) % 3])


TestManager = ManagerMachine.TestCase
TestManager.settings = SMALL
TestCollidingManager = CollidingManagerMachine.TestCase
TestCollidingManager.settings = SMALL


KEYS = ("own", "shared", "unique", "clients")


def simulate(
    seed: int,
    num_gpu: int,
    num_cpu: int,
    budget: int,
    max_num_seqs: int,
    mode: str | None,
    chunked: bool,
    caching: bool,
    watermark: float,
    keys: str,
    window: int | None = None,
    reservation: str = "paged",
) -> list[tuple[tuple[int, int, int], ...]]:
    """Random arrivals (1-3 prompts at a time), forks, finishes and aborts on a tiny cache, checking the
    invariants after every step. `keys` names each group's client request: `own` none (each its own), `shared`
    one for all, `unique` a distinct one each, `clients` one per arrival (its prompts together). Under a sliding
    `window` (every layer's), a sequence holds at most ceil(window / BS) + 1 blocks between steps (run_step checks
    the bound during a step). Under an Orca `reservation` policy each request's max_tokens is its output limit,
    and each sequence's table stays within its extent. Returns what each step scheduled: (seq id, computed, new
    tokens) per sequence."""
    rng = random.Random(seed)
    max_model_len = 16
    if not chunked:
        budget = max(budget, max_model_len)
    if reservation == "paged":
        kv = KVCacheManager(
            BS, num_gpu, num_cpu, watermark=watermark, enable_prefix_caching=caching, sliding_window=window
        )
    else:
        kv = ReservingKVCacheManager(reservation, max_model_len, BS, num_gpu, num_cpu)
        window = None
    cfg = SchedulerConfig(max_num_seqs, budget, max_model_len, mode, chunked)  # type: ignore[arg-type]
    sched = Scheduler(cfg, kv)
    shadow = ShadowCache(BS, window)
    ids = iter(range(10**6))
    limits: dict[int, int] = {}  # seq id -> max output tokens
    forks: dict[str, int] = {}  # request id -> children still to fork after the first sample
    num_requests = rng.randint(1, 10)
    added, arrivals, trace = 0, 0, []
    for step in range(400):
        if added < num_requests and rng.random() < 0.7:
            prompts = min(rng.choice([1, 1, 1, 2, 3]), num_requests - added)
            for _ in range(prompts):
                length = rng.randint(1, 20) if rng.random() < 0.1 else rng.randint(1, 8)
                prompt = [rng.randint(0, 2) for _ in range(length)]
                seq = Sequence(next(ids), prompt)
                limits[seq.seq_id] = rng.randint(1, 8)
                rid = f"r{added}"
                forks[rid] = rng.choice([0, 0, 1, 2])
                client = {
                    "own": None,
                    "shared": "all",
                    "unique": f"c{added}",
                    "clients": f"a{arrivals}" if prompts > 1 else None,
                }[keys]
                group = SequenceGroup(rid, [seq], float(step), client_request_id=client)
                group.max_tokens = limits[seq.seq_id]
                sched.add_seq_group(group)
                added += 1
            arrivals += 1
        out = run_step(sched, shadow, next_token=rng.randint(0, 2))
        trace.append(tuple((s.seq_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled))
        for _rid, reason in out.ignored:
            assert reason
        for s in out.scheduled:
            seq = sched.get_seq(s.seq_id)
            if seq is None or not s.do_sample:
                continue
            # (A child at max_model_len would outgrow its reservation: the engine finishes every sequence there.)
            if forks.get(s.request_id) and not (kv.reserving and seq.num_tokens >= max_model_len):
                for _ in range(forks.pop(s.request_id)):
                    child = seq.fork(next(ids))
                    child.token_ids[-1] = rng.randint(0, 2)
                    limits[child.seq_id] = limits[seq.seq_id] if kv.reserving else rng.randint(1, 8)
                    sched.fork_seq(seq, child)
            forks.pop(s.request_id, None)
            if len(seq.output_token_ids) >= limits[seq.seq_id] or seq.num_tokens >= max_model_len:
                sched.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
        if rng.random() < 0.05 and added:
            sched.abort_seq_group(f"r{rng.randrange(added)}")
        # A forked child's copies under a reservation run at the start of the next step.
        copying = {dst for _, dst in getattr(kv, "_copies", ())}
        for group in sched.running + sched.swapped:
            for seq in group.unfinished_seqs():
                if not copying.intersection(kv.get_block_table(seq.seq_id)):
                    shadow.check_seq(kv, seq)
                held = [b for b in kv.get_block_table(seq.seq_id) if b >= 0]
                assert window is None or len(held) <= -(-window // BS) + 1, (
                    window,
                    kv.get_block_table(seq.seq_id),
                )
        for group in sched.swapped:
            assert all(s.status == SequenceStatus.SWAPPED for s in group.unfinished_seqs())
        queued = sched.running + sched.swapped + sched.waiting
        if not kv.reserving:  # a reservation's snapshot names whole extents, not block tables
            check_snapshot(
                kv, sched.cache_snapshot(), {s.seq_id: g.request_id for g in queued for s in g.seqs}
            )
        if added == num_requests and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "requests stalled"
    kv.check_integrity()
    assert kv.num_free_gpu_blocks == kv.num_gpu_blocks and kv.num_free_cpu_blocks == kv.num_cpu_blocks
    return trace


CONFIGS = {
    "seed": st.integers(0, 2**32 - 1),
    "num_gpu": st.integers(3, 16),
    "num_cpu": st.integers(0, 8),
    "budget": st.integers(1, 24),
    "max_num_seqs": st.integers(1, 5),
    "mode": st.sampled_from(["recompute", "swap", None]),
    "chunked": st.booleans(),
    "caching": st.booleans(),
    "watermark": st.sampled_from([0.0, 0.1, 0.3]),
    "window": st.sampled_from([None, None, 1, 2, 3, 5]),
}


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(keys=st.sampled_from(KEYS), **CONFIGS)
def test_scheduler_simulation(keys: str, **config: Any) -> None:
    """Random arrivals, forks, finishes and aborts on a tiny cache: invariants hold and everything ends, whoever
    shares a client request."""
    simulate(keys=keys, **config)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(**CONFIGS)
def test_single_client_schedules_are_fcfs(**config: Any) -> None:
    """With every request a client request of its own (the offline LLM's batches) or all of one, every step
    schedules the same: taking turns between client requests changes nothing (FCFS, preemptions included)."""
    assert simulate(keys="shared", **config) == simulate(keys="own", **config)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**32 - 1),
    num_prompts=st.integers(20, 80),
    budget=st.integers(8, 24),
    max_num_seqs=st.integers(1, 4),
    max_output=st.integers(1, 4),
    arrives=st.integers(0, 6),
    chunked=st.booleans(),
)
def test_single_prompt_request_waits_bounded_steps(
    seed: int, num_prompts: int, budget: int, max_num_seqs: int, max_output: int, arrives: int, chunked: bool
) -> None:
    """A single-prompt request that arrives while a client request of many prompts runs is scheduled within a
    few steps whatever the number of those prompts: the running sequences' prefill and decode, not the waiting
    ones (FCFS would make it wait for all of them to be admitted)."""
    rng = random.Random(seed)
    max_prompt = 8
    kv = KVCacheManager(BS, 512, 0, watermark=0.0, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs, budget, 64, None, chunked), kv)
    shadow = ShadowCache(BS)
    limits = {}
    for i in range(num_prompts):
        seq = Sequence(i, [rng.randint(0, 2) for _ in range(rng.randint(1, max_prompt))])
        limits[i] = rng.randint(1, max_output)
        sched.add_seq_group(SequenceGroup(f"big-{i}", [seq], 0.0, client_request_id="big"))
    # The running sequences' prefill left (each at most max_prompt tokens), then their decodes, then its turn.
    bound = -(-max_num_seqs * max_prompt // budget) + max_output + 1
    single = Sequence(num_prompts, [1, 2, 3])
    for step in range(arrives + bound + 1):
        if step == arrives:
            sched.add_seq_group(SequenceGroup("single", [single], float(step)))
        out = run_step(sched, shadow)
        if any(s.request_id == "single" for s in out.scheduled):
            assert step - arrives <= bound
            return
        for s in out.scheduled:
            seq = sched.get_seq(s.seq_id)
            if s.do_sample and seq is not None and len(seq.output_token_ids) >= limits[s.seq_id]:
                sched.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
    raise AssertionError(f"the single-prompt request waited more than {bound} steps")


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    prompt_len=st.integers(40, 120),
    budget=st.integers(2, 16),
    arrives=st.integers(0, 3),
    newcomer_len=st.integers(1, 30),
    client=st.sampled_from([None, "big"]),
)
def test_newcomer_waits_one_step_behind_a_long_prefill(
    prompt_len: int, budget: int, arrives: int, newcomer_len: int, client: str | None
) -> None:
    """A request that arrives while a long prompt is being prefilled is scheduled in the next step: the
    prompt's chunks leave it part of the budget (FCFS would hold it for the rest of that prefill)."""
    kv = KVCacheManager(BS, 256, 0, watermark=0.0, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(2, budget, 256), kv)
    shadow = ShadowCache(BS)
    sched.add_seq_group(SequenceGroup("long", [Sequence(0, [1, 2] * (prompt_len // 2))], 0.0))
    for _ in range(arrives + 1):
        run_step(sched, shadow)
    sched.add_seq_group(
        SequenceGroup("new", [Sequence(1, [1] * newcomer_len)], 1.0, client_request_id=client)
    )
    long = sched.get_seq(0)
    assert long is not None
    remaining = long.num_tokens - long.num_computed_tokens
    out = run_step(sched, shadow)
    assert any(s.request_id == "new" for s in out.scheduled), "the newcomer waited behind the prefill"
    # The prefill still advances by at least half a budget.
    advanced = sum(s.num_new_tokens for s in out.scheduled if s.request_id == "long")
    assert advanced >= min(remaining, budget - budget // 2)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    reservation=st.sampled_from(["orca-oracle", "orca-pow2", "orca-max"]),
    keys=st.sampled_from(KEYS),
    **CONFIGS,
)
def test_scheduler_simulation_reserving(reservation: str, keys: str, **config: Any) -> None:
    """The same simulation under each Orca reservation policy: extents never overlap, a sequence's table stays
    inside its extent (check_integrity), forked children read their parent's copied K/V, preemption and finish
    free whole extents (every block free at the end), and nothing stalls."""
    simulate(keys=keys, reservation=reservation, **config)
