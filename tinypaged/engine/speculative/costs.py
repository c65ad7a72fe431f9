"""Verification's cost by k on this machine: the acceptance switch's C(k), measured when a CPU engine starts.

On the CPU the cost of a verification step of k + 1 rows against a one-row decode step is the BLAS's, and it
differs from machine to machine: on the 2-core Xeon where `switch.VERIFY_COSTS` was measured, 2-3 rows cost about
a decode step and 4-7 half as much again; on a 2-core AMD EPYC the same code took 1.62 decode steps at two rows and
1.34 at four, and with the transposed product at a few rows (`tinypaged.cpu_linear`) 1.05 at two and 3.0 at five.
A table from another machine makes the switch pick k where the verification is dear. So a CPU engine measures its
own (`measured_costs`): a decode step of one sequence over `CONTEXT` tokens with k proposed tokens, for each k,
each timed `REPEATS` times after a first pass (the shapes in turn, so that the machine's drift falls on all of
them), the fastest over the k = 0 step's fastest (on a shared machine a neighbour's load only ever adds time),
and never under `MIN_ROW_COST` a verified row. It takes under a second (the default model in float32: 5 shapes,
30 passes of ~20-45 ms). The result is kept for the process, by model and k, so that every engine of
the same model in a process decides alike (a seeded request's output depends on the k its steps propose).
`TINYPAGED_SPEC_COSTS=table` takes `switch.VERIFY_COSTS` instead (side-by-side measurements).
"""

from __future__ import annotations

import os
import time

import torch

from tinypaged.engine.device.model_runner import ModelRunner, scratch_step

# Tokens before the step's: a decode step's attention over a few blocks (fewer in a shorter model).
CONTEXT = 63
REPEATS = 5
# The least a verified row adds: its sampling and acceptance test, host work that the forward passes timed here
# leave out. With the transposed product a one-row decode already runs as two columns, so a two-row pass costs
# what a decode pass does, and timing noise alone would make proposing one token look free at any acceptance.
MIN_ROW_COST = 0.03
_measured: dict[tuple, tuple[float, ...]] = {}


def measured_costs(runner: ModelRunner, max_k: int) -> tuple[float, ...] | None:
    """C(k) for k = 0..max_k on this machine (`runner` a CPU engine's, its KV cache not yet in use: the passes
    write scratch keys and values into its first blocks), or None where it is not measured (a GPU's line is its
    own, measured on the H200; `TINYPAGED_SPEC_COSTS=table`)."""
    if runner.device.type != "cpu" or os.environ.get("TINYPAGED_SPEC_COSTS") == "table":
        return None
    cfg = runner.config
    context = min(CONTEXT, (cfg.max_model_len or CONTEXT + 1 + max_k) - 1 - max_k)
    if context < 0 or runner.num_gpu_blocks * runner.block_size < context + 1 + max_k:
        return None  # a model or a cache too short for the scratch steps
    key = (str(cfg.model), str(runner.dtype), str(cfg.quantization), str(cfg.kv_cache_dtype), max_k)
    if key not in _measured:
        _measured[key] = _measure(runner, max_k, context)
    return _measured[key]


def _measure(runner: ModelRunner, max_k: int, context: int) -> tuple[float, ...]:
    bs = runner.block_size
    steps = [scratch_step([(context, 1 + k)], bs, k) for k in range(max_k + 1)]
    times: list[list[float]] = [[] for _ in steps]
    with torch.inference_mode():
        for rep in range(REPEATS + 1):
            for k, step in enumerate(steps):
                t0 = time.perf_counter()
                runner.execute(step)
                if rep:
                    times[k].append(time.perf_counter() - t0)
    decode = min(times[0])
    return tuple(
        1.0 if k == 0 else round(max(min(t) / decode, 1.0 + MIN_ROW_COST * k), 3) for k, t in enumerate(times)
    )
