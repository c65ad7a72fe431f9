"""The scheduler: which sequences run each step, with how many tokens, and what to preempt, swap or copy.

One job, in about 500 lines: every policy that decides a step's batch lives here together (the running queue
first, swap-in, admission with its turns between client requests, preemption), because each reads the token
budget and the free blocks the others leave; the block bookkeeping itself is the KV cache manager's.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter, deque
from dataclasses import dataclass, field

from tinypaged.core.kv_cache_manager import CacheSnapshot, KVCacheManager, PrefixHit
from tinypaged.core.schedule_types import PreemptionMode, ScheduledSeq, SchedulerConfig, SchedulerOutput
from tinypaged.core.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = ["PreemptionMode", "ScheduledSeq", "Scheduler", "SchedulerConfig", "SchedulerOutput"]


@dataclass
class _Step:
    """The scratch state of one schedule() call."""

    budget: int
    seqs_left: int
    scheduled: list[tuple[Sequence, SequenceGroup, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)

    def commit(
        self, group: SequenceGroup, items: list[tuple[Sequence, int]], copies: list[tuple[int, int]]
    ) -> None:
        self.scheduled.extend((seq, group, n) for seq, n in items)
        self.budget -= sum(n for _, n in items)
        self.seqs_left -= len(items)
        self.copies.extend(copies)


def _by_arrival(group: SequenceGroup) -> float:
    return group.arrival_time


class _Turns:
    """Which waiting group one step offers admission next: the client requests waiting take turns, the one with
    the fewest groups running first, then the one whose last admission is oldest (a single-prompt request's
    never is), then the earliest arrival; a client request's own groups go in arrival order.

    With every group a client request of its own, or all of one client request, this is the waiting queue's
    order: FCFS. The queue is read (once per step) only on the first turn that could differ from it."""

    def __init__(
        self, waiting: list[SequenceGroup], running: list[SequenceGroup], last: dict[str, int]
    ) -> None:
        self.waiting = waiting
        self.running = running
        self.last = last  # client request id -> the number of its latest admission (kept by the Scheduler)
        # One entry per client request waiting: (groups running, latest admission, its head's rank, key).
        self.heap: list[tuple[int, int, int, str]] | None = None
        self.queues: dict[str, deque[tuple[int, SequenceGroup]]] = {}

    def next(self) -> SequenceGroup:
        """The group whose turn it is (self.waiting must not be empty)."""
        if self.heap is None:
            head = self.waiting[0]
            if head.client_request_id is None:
                return head  # a client request of its own, never admitted: no one comes before the head
            self._read_queue()
            assert self.heap is not None
        return self.queues[self.heap[0][3]][0][1]

    def take(self, group: SequenceGroup, admitted: bool, turn: int) -> None:
        """`group` (the one `next` gave) leaves the waiting queue, admitted (as admission number `turn`) or
        ignored."""
        self.waiting.remove(group)
        if admitted and group.client_request_id is not None:
            self.last[group.client_request_id] = turn
        if self.heap is None:
            return
        count, _, _, key = heapq.heappop(self.heap)
        queue = self.queues[key]
        queue.popleft()
        if queue:
            heapq.heappush(self.heap, (count + admitted, self.last.get(key, -1), queue[0][0], key))

    def _read_queue(self) -> None:
        num_running = Counter(g.client_key for g in self.running)
        for rank, group in enumerate(self.waiting):
            self.queues.setdefault(group.client_key, deque()).append((rank, group))
        self.heap = [
            (num_running[key], self.last.get(key, -1), queue[0][0], key) for key, queue in self.queues.items()
        ]
        heapq.heapify(self.heap)


class Scheduler:
    """Continuous batching over waiting / running / swapped queues, each kept in arrival order: running first,
    then swapped-in, then admissions, FCFS except that admission takes turns between client requests
    (`SequenceGroup.client_request_id`: the prompts of one HTTP request), so that a request of many prompts
    cannot hold another's first token for the whole of its prefill."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self._groups: dict[str, SequenceGroup] = {}
        self._seqs: dict[int, tuple[Sequence, SequenceGroup]] = {}
        # Admission's turns between client requests (_Turns): each shared client request's latest admission
        # number, and its groups not finished (its entry goes with the last of them).
        self._num_admissions = 0
        self._latest_arrival = -math.inf  # of every group added so far
        self._last_turn: dict[str, int] = {}
        self._client_groups: Counter[str] = Counter()
        self.num_preemptions = 0  # total so far, recompute and swap
        self.num_swap_outs = 0
        self.num_ignored = 0

    # ---- requests ------------------------------------------------------------------------------------
    def add_seq_group(self, group: SequenceGroup) -> None:
        """Queue a new request (FCFS by arrival_time); its sequences must be new."""
        if group.request_id in self._groups:
            raise ValueError(f"request {group.request_id!r} is already scheduled")
        if any(seq.seq_id in self._seqs or seq.num_computed_tokens for seq in group.seqs):
            raise ValueError(f"request {group.request_id!r} reuses a sequence id or a computed sequence")
        self._groups[group.request_id] = group
        self._latest_arrival = max(self._latest_arrival, group.arrival_time)
        if group.client_request_id is not None:
            self._client_groups[group.client_request_id] += 1
        for seq in group.seqs:
            seq.status = SequenceStatus.WAITING
            self._seqs[seq.seq_id] = (seq, group)
        self.kv.register(group)
        bisect.insort_right(self.waiting, group, key=_by_arrival)

    def get_seq(self, seq_id: int) -> Sequence | None:
        """The unfinished-request sequence with this id, or None."""
        entry = self._seqs.get(seq_id)
        return entry[0] if entry is not None else None

    def get_seq_group(self, request_id: str) -> SequenceGroup | None:
        """The unfinished request with this id, or None."""
        return self._groups.get(request_id)

    def abort_seq_group(self, request_id: str) -> bool:
        """Finish every sequence of the request as aborted and free its blocks; False if unknown."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        for seq in group.unfinished_seqs():
            self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._drop_group(group)
        return True

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """Finish one sequence (stop string, EOS, length) and free its blocks at once."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        entry = self._seqs.get(seq.seq_id)
        if entry is None or seq.status.is_finished:
            return
        self._finish(seq, status)
        if entry[1].is_finished():
            self._drop_group(entry[1])

    def drop_seq(self, seq: Sequence) -> None:
        """Finish a sequence that nothing will read again (a beam the search left behind) and forget it: its
        blocks are freed and it leaves its group, which keeps its other sequences."""
        entry = self._seqs.pop(seq.seq_id, None)
        if entry is None:
            return
        group = entry[1]
        if not seq.status.is_finished:
            self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        self.kv.forget(seq.seq_id)
        group.seqs.remove(seq)
        assert group.seqs, "a group keeps at least one sequence"

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        """Add child to parent's group, sharing every block of the parent (ref counts + 1)."""
        group = self._seqs[parent.seq_id][1]
        if child.seq_id in self._seqs:
            raise ValueError(f"seq {child.seq_id} already exists")
        self.kv.fork(parent.seq_id, child.seq_id)
        child.status = parent.status
        # A reserving cache that found the child no extent yet: it recomputes its tokens when it next runs.
        copied = not self.kv.reserving or self.kv.get_block_table(child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens if copied else 0
        if all(s is not child for s in group.seqs):
            group.seqs.append(child)
        self._seqs[child.seq_id] = (child, group)

    def cache_snapshot(self) -> CacheSnapshot:
        """The KV cache's pools with each held block's request ids (`KVCacheManager.snapshot`); between steps."""
        return self.kv.snapshot({seq_id: group.request_id for seq_id, (_, group) in self._seqs.items()})

    def has_unfinished(self) -> bool:
        """True while any request is waiting, running or swapped."""
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running(self) -> int:
        """Requests whose blocks are on the GPU."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests not admitted yet (or preempted by recompute)."""
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        """Requests whose blocks are swapped out to CPU."""
        return len(self.swapped)

    # ---- one step ------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running first, then swapped-in, then new requests, within the budget."""
        st = _Step(budget=self.config.max_num_batched_tokens, seqs_left=self.config.max_num_seqs)
        st.copies.extend(self.kv.take_copies())
        self._schedule_running(st)
        # After a preemption memory is short: admitting or swapping in now would only thrash.
        if not st.preempted:
            self._schedule_swapped(st)
            # Swapped groups come back before any new request takes their blocks.
            if not self.swapped:
                self._schedule_waiting(st)
        scheduled = tuple(self._scheduled(seq, group, n) for seq, group, n in st.scheduled)
        return SchedulerOutput(
            scheduled=scheduled,
            blocks_to_swap_out=tuple(st.swap_out),
            blocks_to_swap_in=tuple(st.swap_in),
            blocks_to_copy=tuple(st.copies),
            preempted=tuple(st.preempted),
            ignored=tuple(st.ignored),
            num_batched_tokens=sum(s.num_new_tokens for s in scheduled),
        )

    def update_from_output(self, out: SchedulerOutput) -> None:
        """Advance each scheduled sequence past the tokens just computed; cache its newly full blocks and give
        back those its window has passed."""
        for s in out.scheduled:
            entry = self._seqs.get(s.seq_id)
            if entry is None:
                continue  # aborted or finished since schedule()
            seq = entry[0]
            if seq.status != SequenceStatus.RUNNING or seq.num_computed_tokens != s.num_computed_tokens:
                continue
            seq.num_computed_tokens += s.num_new_tokens
            self.kv.cache_block(seq)
            if not s.num_spec_tokens:  # else once the rejected positions are rolled back
                self.kv.free_out_of_window(seq)

    def rollback(self, seq: Sequence, num_rejected: int) -> None:
        """Speculative decoding, after a verification step: the last `num_rejected` positions it computed held
        proposed tokens that the target rejected. The sequence's computed tokens end before them, and the blocks
        only they reached go back to the pool (their K/V is never read: the next step overwrites those slots)."""
        if seq.status != SequenceStatus.RUNNING:
            return  # finished or aborted meanwhile: its blocks are already free
        if num_rejected:
            seq.num_computed_tokens -= num_rejected
            self.kv.trim(seq)
        self.kv.free_out_of_window(seq)

    # ---- phases --------------------------------------------------------------------------------------
    def _schedule_running(self, st: _Step) -> None:
        # A prefill admitted before a request now waiting arrived leaves it half the step's budget, so that a
        # long prompt holds a newcomer's first token for one step, not for the whole of its prefill. A batch
        # that arrives at once (LLM.generate's) has no newcomer: its schedule stays FCFS.
        on = self.waiting and self.config.enable_chunked_prefill
        newest = self.waiting[-1].arrival_time if on else -math.inf
        reserve = self.config.max_num_batched_tokens // 2
        i = 0
        while i < len(self.running) and st.budget > 0 and st.seqs_left > 0:
            group = self.running[i]
            items = self._chunk(
                group.get_seqs(SequenceStatus.RUNNING),
                st,
                reserve=reserve if newest > group.arrivals_seen else 0,
            )
            if not items:
                i += 1
                continue
            copies = self.kv.allocate_group_slots(items)
            while copies is None:
                victim = self.running[-1]  # the latest-arrived group
                if victim is not group:
                    self._preempt(victim, st)
                    copies = self.kv.allocate_group_slots(items)
                elif i > 0:
                    self._preempt(group, st)
                    break
                elif len(items) > 1:
                    # Alone on the GPU: run as many of its sequences as fit; the rest wait for blocks.
                    items.pop()
                    copies = self.kv.allocate_group_slots(items)
                else:
                    # Alone on the GPU and one sequence still does not fit: it can never continue.
                    self.running.pop()
                    self._ignore(group, self.kv.outgrown, st)
                    break
            if copies is not None:
                st.commit(group, items, copies)
                i += 1

    def _schedule_swapped(self, st: _Step) -> None:
        if not self.swapped:
            return
        num_running_seqs = self._num_running_seqs()
        while self.swapped and st.budget > 0 and st.seqs_left > 0:
            group = self.swapped[0]
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            if self.running and num_running_seqs + len(seqs) > self.config.max_num_seqs:
                return
            items = self._chunk(seqs, st)
            if not self._fits_swap_in(group, items):
                if self.running:
                    return
                # Nothing else holds GPU blocks: bring back the sequences that fit; if even one alone does
                # not, it never will.
                while len(items) > 1 and not self._fits_swap_in(group, items):
                    items.pop()
                if not self._fits_swap_in(group, items):
                    self.swapped.pop(0)
                    self._ignore(group, "the request needs more blocks than the whole KV cache", st)
                    continue
            st.swap_in.extend(self.kv.swap_in(group))
            group.arrivals_seen = self._latest_arrival
            self.swapped.pop(0)
            self._set_status(seqs, SequenceStatus.RUNNING)
            bisect.insort_right(self.running, group, key=_by_arrival)
            num_running_seqs += len(seqs)
            copies = self.kv.allocate_group_slots(items)
            assert copies is not None, "swap-in checked the blocks this chunk needs"
            st.commit(group, items, copies)

    def _schedule_waiting(self, st: _Step) -> None:
        if not self.waiting:
            return
        num_running_seqs = self._num_running_seqs()
        turns = _Turns(self.waiting, self.running, self._last_turn)
        while self.waiting and st.budget > 0 and st.seqs_left > 0:
            group = turns.next()
            seqs = group.get_seqs(SequenceStatus.WAITING)
            reason = self._never_fits(seqs)
            if reason is not None:
                turns.take(group, admitted=False, turn=self._num_admissions)
                self._ignore(group, reason, st)
                continue
            if self.running and num_running_seqs + len(seqs) > self.config.max_num_seqs:
                return
            # Look without taking: a group refused here leaves the KV cache manager exactly as it found it.
            hits = {seq.seq_id: self.kv.lookup_prefix(seq, group.reads_prefix_cache) for seq in seqs}
            items = self._chunk(seqs, st, hits)
            # The watermark keeps room for running sequences to grow; with nothing running it only stalls.
            reserve = self.kv.watermark_blocks if self.running else 0
            if not items or not self.kv.can_admit(items, hits, reserve):
                return
            for seq in seqs:
                self.kv.take_prefix(seq, hits[seq.seq_id])
                seq.num_computed_tokens = hits[seq.seq_id].num_tokens
                self.kv.free_out_of_window(seq)  # a hit longer than the window: its head goes back, cached
            copies = self.kv.allocate_group_slots(items)
            assert copies is not None, "admission checked the blocks this chunk needs"
            self._num_admissions += 1
            turns.take(group, admitted=True, turn=self._num_admissions)
            group.arrivals_seen = self._latest_arrival
            self._set_status(seqs, SequenceStatus.RUNNING)
            bisect.insort_right(self.running, group, key=_by_arrival)
            num_running_seqs += len(seqs)
            st.commit(group, items, copies)

    # ---- helpers -------------------------------------------------------------------------------------
    def _chunk(
        self, seqs: list[Sequence], st: _Step, hits: dict[int, PrefixHit] | None = None, reserve: int = 0
    ) -> list[tuple[Sequence, int]]:
        """(seq, num_new_tokens) for the sequences that need compute, within the step's budget (a prefill
        chunk leaves `reserve` of it); a waiting sequence's chunk starts after its prefix hit."""
        items: list[tuple[Sequence, int]] = []
        budget, seqs_left = st.budget, st.seqs_left
        for seq in seqs:
            computed = hits[seq.seq_id].num_tokens if hits is not None else seq.num_computed_tokens
            remaining = seq.num_tokens - computed
            if remaining <= 0:
                continue
            # A decode verifies the tokens proposed after it (speculative decoding), as many as the budget has.
            want = remaining + len(seq.spec_token_ids) if remaining == 1 else remaining
            n = min(want, budget if remaining == 1 else budget - reserve)
            if n <= 0 or seqs_left <= 0 or (n < remaining and not self.config.enable_chunked_prefill):
                break
            items.append((seq, n))
            budget -= n
            seqs_left -= 1
        return items

    def _scheduled(self, seq: Sequence, group: SequenceGroup, n: int) -> ScheduledSeq:
        """The plain-data record of one sequence's work this step (n new tokens, proposed ones last)."""
        first = seq.num_computed_tokens
        spec = max(0, n - (seq.num_tokens - first))
        return ScheduledSeq(
            seq_id=seq.seq_id,
            request_id=group.request_id,
            num_computed_tokens=first,
            num_new_tokens=n,
            token_ids=tuple(seq.token_ids[first : first + n - spec]) + seq.spec_token_ids[:spec],
            block_table=tuple(self.kv.get_block_table(seq.seq_id)),
            do_sample=first + n - spec == seq.num_tokens,
            num_spec_tokens=spec,
        )

    def _fits_swap_in(self, group: SequenceGroup, items: list[tuple[Sequence, int]]) -> bool:
        # The watermark keeps room for running sequences to grow; with nothing running it only stalls.
        need = self.kv.blocks_needed(items)
        return self.kv.can_swap_in(group, need, use_watermark=bool(self.running))

    def _never_fits(self, seqs: list[Sequence]) -> str | None:
        cfg = self.config
        for seq in seqs:
            if seq.num_tokens > cfg.max_model_len:
                return f"sequence of {seq.num_tokens} tokens is longer than max_model_len={cfg.max_model_len}"
            if not cfg.enable_chunked_prefill and seq.num_tokens > cfg.max_num_batched_tokens:
                return (
                    f"sequence of {seq.num_tokens} tokens exceeds max_num_batched_tokens="
                    f"{cfg.max_num_batched_tokens} and chunked prefill is off"
                )
        num_blocks = self.kv.blocks_to_admit(seqs)
        if num_blocks > self.kv.num_gpu_blocks:
            return f"needs {num_blocks} KV cache blocks but the GPU cache has only {self.kv.num_gpu_blocks}"
        return None

    def _preempt(self, group: SequenceGroup, st: _Step) -> None:
        self.running.remove(group)
        self.num_preemptions += 1
        st.preempted.append(group.request_id)
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        mode = self.config.preemption_mode
        # Swapping keeps the shared blocks of a multi-sequence group shared; recompute would lose that.
        if (mode == "swap" or (mode is None and len(seqs) > 1)) and self.kv.can_swap_out(group):
            st.swap_out.extend(self.kv.swap_out(group))
            self._set_status(seqs, SequenceStatus.SWAPPED)
            bisect.insort_right(self.swapped, group, key=_by_arrival)
            self.num_swap_outs += 1
            return
        for seq in seqs:
            # Generated tokens stay in token_ids: recompute rebuilds their K/V and generation continues.
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
        self._set_status(seqs, SequenceStatus.WAITING)
        bisect.insort_left(self.waiting, group, key=_by_arrival)

    def _ignore(self, group: SequenceGroup, reason: str, st: _Step) -> None:
        """Finish a group that can never be scheduled (it is already out of every queue)."""
        for seq in group.unfinished_seqs():
            self._finish(seq, SequenceStatus.FINISHED_IGNORED)
        if self._groups.pop(group.request_id, None) is not None:
            self._forget_client(group)
        for seq in group.seqs:
            self._seqs.pop(seq.seq_id, None)
            self.kv.forget(seq.seq_id)
        st.ignored.append((group.request_id, reason))
        self.num_ignored += 1

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        seq.num_pending = 0  # samples still in flight for it are dropped
        self.kv.free(seq.seq_id)

    def _drop_group(self, group: SequenceGroup) -> None:
        for queue in (self.running, self.waiting, self.swapped):
            for i, g in enumerate(queue):
                if g is group:
                    del queue[i]
                    break
        if self._groups.pop(group.request_id, None) is not None:
            self._forget_client(group)
        for seq in group.seqs:
            self._seqs.pop(seq.seq_id, None)
            self.kv.forget(seq.seq_id)

    def _forget_client(self, group: SequenceGroup) -> None:
        """A group has left the scheduler: its client request's turn is forgotten with its last group."""
        key = group.client_request_id
        if key is None:
            return
        self._client_groups[key] -= 1
        if not self._client_groups[key]:
            del self._client_groups[key]
            self._last_turn.pop(key, None)

    def _num_running_seqs(self) -> int:
        return sum(g.num_unfinished_seqs() for g in self.running)

    @staticmethod
    def _set_status(seqs: list[Sequence], status: SequenceStatus) -> None:
        for seq in seqs:
            seq.status = status
