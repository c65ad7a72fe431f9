"""Server metrics in the Prometheus text format (version 0.0.4), with vLLM's metric names under `tinypaged:`.

Gauges and token counters are read from the engine at scrape time; latency histograms and the finished-request
counter are observed here as requests stream through the server.

While the engine cannot serve (its core dead or stalled, or shut down), `tinypaged:engine_healthy` is 0 and a
comment line says why; the gauges only the engine knows (its queues, its KV cache, its core's memory) are left
out, since their last values are no longer true, and Prometheus marks their series stale. The counters keep the
last values the engine reported (true counts up to then; a counter never goes back); the server's own metrics
(latencies, finished requests, its memory) go on.
"""

from __future__ import annotations

import bisect
import math
import os
from collections import Counter

from tinypaged.engine.step.stats import EngineStats, StepStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)

# (metric name, type, help, the engine's stats() field): read at scrape time.
ENGINE_METRICS = (
    ("num_requests_running", "gauge", "Number of requests running on the GPU (in the batch).", "num_running"),
    ("num_requests_waiting", "gauge", "Number of requests waiting to be scheduled.", "num_waiting"),
    ("num_requests_swapped", "gauge", "Number of requests swapped out to CPU memory.", "num_swapped"),
    (
        "gpu_cache_usage_perc",
        "gauge",
        "GPU KV cache usage: 1 means 100 percent of blocks used.",
        "gpu_cache_usage",
    ),
    ("cpu_cache_usage_perc", "gauge", "CPU (swap) KV cache usage: 1 means 100 percent.", "cpu_cache_usage"),
    ("num_gpu_blocks", "gauge", "KV cache blocks on the GPU (the pool's size).", "num_gpu_blocks"),
    (
        "num_free_gpu_blocks",
        "gauge",
        "Free KV cache blocks on the GPU (cached blocks no request holds count as free).",
        "num_free_gpu_blocks",
    ),
    ("num_preemptions", "counter", "Cumulative number of preemptions.", "num_preemptions"),
    ("prompt_tokens", "counter", "Number of prefill tokens processed.", "prompt_tokens_total"),
    ("generation_tokens", "counter", "Number of generation tokens processed.", "generation_tokens_total"),
    (
        "prefix_cache_queries",
        "counter",
        "Prompt blocks looked up in the prefix cache at admission.",
        "prefix_cache_queries_total",
    ),
    ("prefix_cache_hits", "counter", "Prompt blocks found in the prefix cache.", "prefix_cache_hits_total"),
    ("engine_steps", "counter", "Engine steps run.", "num_steps"),
    # Speculative decoding (vLLM's names); acceptance rate = accepted tokens / draft tokens.
    (
        "spec_decode_num_drafts",
        "counter",
        "Proposals verified (speculative decoding).",
        "spec_decode_num_drafts",
    ),
    (
        "spec_decode_num_draft_tokens",
        "counter",
        "Draft tokens proposed and verified.",
        "spec_decode_num_draft_tokens",
    ),
    (
        "spec_decode_num_accepted_tokens",
        "counter",
        "Draft tokens the target accepted.",
        "spec_decode_num_accepted_tokens",
    ),
)


def resident_memory_bytes(pid: int | None = None) -> int | None:
    """A process's resident set size (this one's by default; Linux: /proc/PID/statm); None where it cannot be
    read."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class Histogram:
    """A cumulative-bucket histogram, as Prometheus exposes one."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is the +Inf overflow
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Count one observation."""
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, labels: str) -> list[str]:
        """The family's lines; `labels` is the rendered label set without braces."""
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            running += n
            lines.append(f'{self.name}_bucket{{{labels},le="{_number(float(bound))}"}} {running}')
        lines += [
            f"{self.name}_sum{{{labels}}} {_number(self.sum)}",
            f"{self.name}_count{{{labels}}} {self.count}",
        ]
        return lines


class ServerMetrics:
    """Everything `/metrics` exposes for one served model."""

    prefix = "tinypaged:"

    def __init__(self, model_name: str, cache_config: dict[str, str] | None = None) -> None:
        """`cache_config`: the engine's settings `cache_config_info` reports as labels (as vLLM's gauge of that
        name: block size, KV cache dtype, ...)."""
        self.labels = f'model_name="{_escape(model_name)}"'
        self.cache_config = cache_config or {}
        p = self.prefix
        self.ttft = Histogram(
            f"{p}time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.tpot = Histogram(
            f"{p}time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            TPOT_BUCKETS,
        )
        self.e2e = Histogram(
            f"{p}e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            E2E_BUCKETS,
        )
        self.iteration_tokens = Histogram(
            f"{p}iteration_tokens_total", "Histogram of tokens per engine step.", ITERATION_TOKENS_BUCKETS
        )
        self.step_time = Histogram(
            f"{p}engine_step_seconds",
            "Histogram of the host time of one engine step (schedule, execute, sample, update).",
            STEP_BUCKETS,
        )
        self.finished: Counter[str] = Counter()

    def observe_step(self, stats: StepStats) -> None:
        """Count one engine step (the engine calls this with each step's statistics)."""
        tokens = stats.num_prefill_tokens + stats.num_decode_tokens
        if tokens:
            self.iteration_tokens.observe(tokens)
        self.step_time.observe(stats.total_s)

    def request_finished(self, finish_reason: str | None) -> None:
        """Count a request that ran to its end (stop or length), or one that was aborted."""
        self.finished[finish_reason or "abort"] += 1

    def render(self, stats: EngineStats, core_pid: int | None = None, unavailable: str | None = None) -> str:
        """The whole exposition; `stats` is the engine's `stats()`, `core_pid` its engine-core process (if it
        runs in one: its resident memory is reported beside this process's), `unavailable` why the engine
        cannot serve (None while it serves: its gauges are reported only then)."""
        full = f"{self.prefix}engine_healthy"
        lines = [
            f"# HELP {full} 1 while the engine serves; 0 while it cannot (dead, stalled, shut down): then the "
            "gauges of its load and memory are left out.",
            f"# TYPE {full} gauge",
            f"{full}{{{self.labels}}} {0 if unavailable else 1}",
        ]
        if unavailable:
            lines.append(f"# tinypaged: the engine is unavailable ({' '.join(unavailable.split())})")
        for name, kind, help_text, field in ENGINE_METRICS:
            if unavailable and kind == "gauge":
                continue
            # The classic text format names a counter with its `_total` suffix on the TYPE line too.
            full = self.prefix + name + ("_total" if kind == "counter" else "")
            lines += [
                f"# HELP {full} {help_text}",
                f"# TYPE {full} {kind}",
                f"{full}{{{self.labels}}} {_number(getattr(stats, field))}",
            ]
        if self.cache_config:
            full = f"{self.prefix}cache_config_info"
            info = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(self.cache_config.items()))
            lines += [
                f"# HELP {full} The engine's KV cache and weight settings, as labels (the value is always 1).",
                f"# TYPE {full} gauge",
                f"{full}{{{self.labels},{info}}} 1",
            ]
        if stats.startup:  # how long the engine took to become ready, phase by phase (fixed once it serves)
            full = f"{self.prefix}startup_phase_seconds"
            lines += [
                f"# HELP {full} Seconds of each phase of the engine's startup (weights, kv_cache, graph_capture, "
                "warmup: compiling what requests launch; total: to ready).",
                f"# TYPE {full} gauge",
            ]
            lines += [
                f'{full}{{{self.labels},phase="{_escape(name)}"}} {_number(float(s))}'
                for name, s in stats.startup
            ]
        if stats.spec_decode_accepted_by_position:
            full = f"{self.prefix}spec_decode_num_accepted_tokens_per_pos_total"
            lines += [
                f"# HELP {full} Draft tokens accepted, by position in their proposal (0: the first).",
                f"# TYPE {full} counter",
            ]
            lines += [
                f'{full}{{{self.labels},position="{j}"}} {n}'
                for j, n in enumerate(stats.spec_decode_accepted_by_position)
            ]
        full = f"{self.prefix}request_success_total"
        lines += [f"# HELP {full} Count of finished requests by finish reason.", f"# TYPE {full} counter"]
        for reason in sorted(self.finished):
            lines.append(
                f'{full}{{{self.labels},finished_reason="{_escape(reason)}"}} {self.finished[reason]}'
            )
        for hist in (self.ttft, self.tpot, self.e2e, self.iteration_tokens, self.step_time):
            lines += hist.render(self.labels)
        rss = resident_memory_bytes()
        if rss is not None:  # the name Prometheus clients give it, without our prefix
            lines += [
                "# HELP process_resident_memory_bytes Resident memory size in bytes.",
                "# TYPE process_resident_memory_bytes gauge",
                f"process_resident_memory_bytes {rss}",
            ]
        core_rss = resident_memory_bytes(core_pid) if core_pid is not None and not unavailable else None
        if core_rss is not None:
            full = f"{self.prefix}engine_core_resident_memory_bytes"
            lines += [
                f"# HELP {full} Resident memory size of the engine-core process in bytes.",
                f"# TYPE {full} gauge",
                f"{full}{{{self.labels}}} {core_rss}",
            ]
        return "\n".join(lines) + "\n"
