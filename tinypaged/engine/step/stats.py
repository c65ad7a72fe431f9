"""What the engine reports about itself: one step's statistics, and its load right now. Plain data, no torch:
metrics, benchmarks and tests read these instead of reaching into the engine."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinypaged.core.block_pool import BlockEvent
from tinypaged.core.kv_cache_manager import CacheSnapshot
from tinypaged.outputs import RequestOutput

if TYPE_CHECKING:  # no torch at import: the server reads these
    from tinypaged.core.kv_cache_manager import KVCacheManager
    from tinypaged.core.scheduler import Scheduler, SchedulerOutput
    from tinypaged.core.sequence import SequenceGroup
    from tinypaged.engine.device.model_runner import GraphChoice
    from tinypaged.engine.request import Request
    from tinypaged.engine.step.queued_step import QueuedStep


class StepTimer:
    """Where a step's phases begin and end (time.perf_counter()): started with the step, marked as it goes."""

    __slots__ = ("start", "schedule_end", "execute_end", "sample_start", "sample_end", "end")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.schedule_end = self.execute_end = self.sample_start = self.sample_end = self.end = self.start

    def scheduled(self) -> None:
        """The schedule is made (grammars admitted, ignored requests ended)."""
        self.schedule_end = time.perf_counter()

    def executed(self) -> None:
        """The forward pass is queued; sampling starts now unless the last step's tokens are applied first."""
        self.execute_end = self.sample_start = time.perf_counter()

    def applied_early(self) -> None:
        """The last step's tokens were applied before sampling (the token masks start from them)."""
        self.sample_start = time.perf_counter()

    def sampled(self) -> None:
        """The sampling pass is queued."""
        self.sample_end = time.perf_counter()

    def stop(self) -> None:
        """Every token of the step is applied."""
        self.end = time.perf_counter()


@dataclass(frozen=True)
class StepStats:
    """What one `LLMEngine.step()` call did, and the host time of each of its phases (seconds).

    Under async scheduling a call applies the tokens of the step before it (`applied_steps`), so a step's
    forward pass and the processing of its tokens are reported by two consecutive calls.
    """

    step: int  # this call's index, from 0
    num_seqs: int  # sequences in this step's forward pass
    num_prefill_tokens: int  # tokens of chunks that do not sample, or sample after more than one new token
    num_decode_tokens: int  # one-token chunks that sample (a decode)
    num_partial_prefills: int  # sequences whose chunk stops short of their last token (chunked prefill)
    num_draws: int  # next-token draws queued: tokens sampled, or log-probability rows scored (beams)
    num_constrained: int  # of those, draws that follow a grammar (structured outputs: their rows masked)
    graph_batch_size: int  # > 0: the forward pass replayed the decode graph captured for this batch size
    graph_num_tokens: int  # > 0: it replayed the graph of steps with prefill chunks of this many tokens
    num_preempted: int  # requests preempted by this step's schedule
    num_preempted_pending: int  # sequences preempted with a sampled token still on the device
    num_blocks_swapped_out: int
    num_blocks_swapped_in: int
    num_blocks_copied: int  # copy-on-write copies
    num_ignored: int  # requests ended without running (they can never fit)
    num_finished: int  # requests whose final output this call returned
    deferred: bool  # this step's tokens stay on the device until the next call applies them
    applied_steps: tuple[int, ...]  # the steps whose tokens this call applied (none, its own, the last)
    num_free_blocks: int  # free KV blocks after the step (cached free blocks count)
    num_kv_tokens: int  # tokens whose K/V the running sequences hold after the step
    schedule_s: float
    execute_s: float  # block moves and the forward pass, as queued (a GPU runs it asynchronously)
    sample_s: float  # the sampling pass, as queued (token masks included)
    mask_s: float  # part of sample_s filling the grammars' token masks on the host (structured outputs)
    update_s: float  # applying tokens: forks, appends, stop checks, detokenization, outputs
    wait_s: float  # part of update_s spent waiting for sampled tokens to reach the host
    total_s: float
    # Device time of each applied step's forward pass, when `ModelRunner.time_device` is on (CUDA only).
    device_s: tuple[float, ...] = ()
    # KV waste after the step (docs/paper-eval.md), in token slots unless named blocks: slots reserved by an
    # Orca policy's extents beyond the blocks their sequences have reached (paged: 0); slots of blocks in block
    # tables not holding a computed token (the last partial block; shared blocks make it a lower bound);
    # the longest run of free blocks, and the free blocks outside it (external fragmentation; paged: 0).
    num_reserved_unused_slots: int = 0
    num_internal_waste_slots: int = 0
    largest_free_extent: int = 0
    num_external_free_blocks: int = 0
    # The prefix cache's changes since the last step's (block hashes stored, removed, or all cleared), in
    # order: a subscriber that replays every step's holds the cached hashes (a KV-aware router's view).
    kv_events: tuple[BlockEvent, ...] = ()
    # Speculative decoding (vLLM's spec-decode counters): proposed tokens verified in this step, how many the
    # target accepted, accepted ones by position in their proposal, and whether the step speculated at all.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_by_position: tuple[int, ...] = ()

    @classmethod
    def of(
        cls,
        index: int,
        sched: SchedulerOutput,
        graph: GraphChoice | None,
        queued: QueuedStep | None,
        applied: list[QueuedStep],
        outputs: list[RequestOutput],
        timer: StepTimer,
        num_preempted_pending: int,
        num_free_blocks: int,
        running: Iterable[SequenceGroup],
        kv: KVCacheManager | None = None,
        kv_events: tuple[BlockEvent, ...] = (),
    ) -> StepStats:
        """A finished step's statistics: its schedule, the graph its forward pass replayed (None: it ran no
        forward pass), the step it queued, the steps it applied, its outputs, its timer, and after it the
        sequences preempted with a pending token, the free KV blocks, the running groups and the KV cache."""
        num_kv_tokens = sum(
            s.num_computed_tokens for g in running for s in g.seqs if not s.status.is_finished
        )
        unused = internal = 0
        largest = num_free_blocks
        if kv is not None:
            unused_blocks, largest = kv.reservation_stats()
            unused = unused_blocks * kv.block_size
            in_tables = (kv.num_gpu_blocks - num_free_blocks - unused_blocks) * kv.block_size
            internal = max(0, in_tables - num_kv_tokens)
        decode = partial = 0
        for s in sched.scheduled:
            decode += s.num_new_tokens == 1 and s.do_sample
            partial += not s.do_sample
        by_position: list[int] = []
        drafted = accepted = 0
        for _, d, v in queued.spec_draws if queued is not None else ():
            drafted += len(d.spec)
            accepted += v.num_accepted
            by_position += [0] * (len(d.spec) - len(by_position))
            for j in range(v.num_accepted):
                by_position[j] += 1
        t = timer
        return cls(
            step=index,
            num_seqs=len(sched.scheduled),
            num_prefill_tokens=sched.num_batched_tokens - decode,
            num_decode_tokens=decode,
            num_partial_prefills=partial,
            num_draws=queued.num_draws if queued is not None else 0,
            num_constrained=queued.num_constrained if queued is not None else 0,
            graph_batch_size=graph.batch_size if graph is not None else 0,
            graph_num_tokens=graph.num_tokens if graph is not None else 0,
            num_preempted=len(sched.preempted),
            num_preempted_pending=num_preempted_pending,
            num_blocks_swapped_out=len(sched.blocks_to_swap_out),
            num_blocks_swapped_in=len(sched.blocks_to_swap_in),
            num_blocks_copied=len(sched.blocks_to_copy),
            num_ignored=len(sched.ignored),
            num_finished=sum(1 for o in outputs if o.finished),
            deferred=queued is not None and queued.deferred,
            applied_steps=tuple(s.index for s in applied),
            num_free_blocks=num_free_blocks,
            num_kv_tokens=num_kv_tokens,
            schedule_s=t.schedule_end - t.start,
            execute_s=t.execute_end - t.schedule_end,
            sample_s=t.sample_end - t.sample_start,
            mask_s=queued.mask_s if queued is not None else 0.0,
            update_s=t.end - t.sample_end + t.sample_start - t.execute_end,
            wait_s=sum(s.wait_s for s in applied),
            total_s=t.end - t.start,
            device_s=tuple(s.device_s for s in applied if s.device_s is not None),
            num_reserved_unused_slots=unused,
            num_internal_waste_slots=internal,
            largest_free_extent=largest,
            num_external_free_blocks=num_free_blocks - largest,
            kv_events=kv_events,
            num_draft_tokens=drafted,
            num_accepted_tokens=accepted,
            accepted_by_position=tuple(by_position),
        )


@dataclass(frozen=True)
class StepResult:
    """What `LLMEngine.step()` returns: the outputs of the requests it advanced, and its statistics."""

    outputs: list[RequestOutput]
    stats: StepStats


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load and counters, for /metrics and tests."""

    num_running: int  # requests
    num_waiting: int
    num_waiting_seqs: int  # the sequences waiting requests will run (prompts x best_of, or n)
    num_swapped: int
    gpu_cache_usage: float  # 0..1 of the KV blocks in use
    cpu_cache_usage: float  # 0..1 of the swap blocks in use
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_preemptions: int  # total so far
    num_steps: int  # total so far
    prompt_tokens_total: int  # prompt tokens of requests whose prefill completed
    generation_tokens_total: int  # tokens sampled (beam search: one per live beam per step)
    prefix_cache_queries_total: int  # prompt blocks looked up in the prefix cache (at admission)
    prefix_cache_hits_total: int  # of those, found computed
    # The engine's startup phases and their seconds (weights, kv_cache, graph_capture, warmup, total).
    startup: tuple[tuple[str, float], ...] = ()
    # Speculative decoding, totals so far (vLLM's spec_decode counters): proposals verified, tokens proposed in
    # them, tokens accepted, and accepted tokens by position in their proposal.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_by_position: tuple[int, ...] = ()

    @classmethod
    def of(
        cls,
        sched: Scheduler,
        kv: KVCacheManager,
        requests: Mapping[str, Request],
        compiling: tuple[int, int],
        counters: tuple[int, int, int],
        startup: tuple[tuple[str, float], ...] = (),
        spec: tuple[int, int, int, tuple[int, ...]] = (0, 0, 0, ()),
    ) -> EngineStats:
        """The engine's load now: its scheduler's queues, its KV cache, its requests by id, the requests waiting
        for a grammar and their sequences, its counters (steps, prompt tokens, generated tokens) and its
        startup phases."""
        num_steps, prompt_tokens, generation_tokens = counters
        return cls(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting + compiling[0],
            num_waiting_seqs=sum(
                req.params.num_seqs for g in list(sched.waiting) if (req := requests.get(g.request_id))
            )
            + compiling[1],
            num_swapped=sched.num_swapped,
            gpu_cache_usage=kv.gpu_usage,
            cpu_cache_usage=1.0 - kv.num_free_cpu_blocks / kv.num_cpu_blocks if kv.num_cpu_blocks else 0.0,
            num_gpu_blocks=kv.num_gpu_blocks,
            num_free_gpu_blocks=kv.num_free_gpu_blocks,
            num_cpu_blocks=kv.num_cpu_blocks,
            num_free_cpu_blocks=kv.num_free_cpu_blocks,
            num_preemptions=sched.num_preemptions,
            num_steps=num_steps,
            prompt_tokens_total=prompt_tokens,
            generation_tokens_total=generation_tokens,
            prefix_cache_queries_total=kv.num_prefix_queried_blocks,
            prefix_cache_hits_total=kv.num_prefix_hit_blocks,
            startup=startup,
            spec_decode_num_drafts=spec[0],
            spec_decode_num_draft_tokens=spec[1],
            spec_decode_num_accepted_tokens=spec[2],
            spec_decode_accepted_by_position=spec[3],
        )


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine between two steps, for the server's cache view: both KV block pools with their holders'
    request ids, and the load and counters at that same moment."""

    cache: CacheSnapshot
    stats: EngineStats
