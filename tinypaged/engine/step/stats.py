"""What the engine reports about itself: one step's statistics, and its load right now. Plain data, no torch:
metrics, benchmarks and tests read these instead of reaching into the engine."""

from __future__ import annotations

from dataclasses import dataclass

from tinypaged.core.kv_cache_manager import CacheSnapshot
from tinypaged.outputs import RequestOutput


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


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine between two steps, for the server's cache view: both KV block pools with their holders'
    request ids, and the load and counters at that same moment."""

    cache: CacheSnapshot
    stats: EngineStats
