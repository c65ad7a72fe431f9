"""Where an engine step's host time goes, for steps the device waits on (a speculative verification: the next
proposals need this step's tokens, so nothing overlaps the host's work).

- `host_profile`: cProfile over one request's steps, each function's own time (tottime) and its time with
  callees (cumtime) per engine step, the longest first. cProfile slows Python calls, so the figures are upper
  bounds for Python-heavy functions; C calls (a CUDA graph's launch, a tensor copy) are timed as they are.
- `graph_launch`: each captured CUDA graph of the given keys replayed alone on an idle device, its padding rows
  only (slot -1, length 0: nothing is written to the cache): the host time of `replay()` (the launch call's
  return), the wall time to the device's end (launch and run), and the device time between events around it.
  Wall minus device is what the launch costs a step that waits for it.

Used by `speculative.py --part gpu` (batch 1, k = 4) and `latency.py --host-profile`.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from tinypaged import LLM


def host_profile(llm: LLM, run: Callable[[], int], top: int = 25) -> dict[str, Any]:
    """cProfile over `run()`, which steps the engine and returns how many steps it took: the `top` functions
    by own time and by time with callees, in seconds per step, and the profiled wall time per step."""
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    steps = run()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, func), (_cc, calls, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = path.split("tinypaged/")[-1] if "tinypaged/" in path else path.rsplit("/", 1)[-1]
        rows.append({"function": f"{where}:{line}({func})", "calls": calls, "tottime": tt, "cumtime": ct})
    steps = max(steps, 1)

    def per_step(key: str) -> list[dict[str, Any]]:
        best = sorted(rows, key=lambda r: -r[key])[:top]
        return [
            {
                "function": r["function"],
                "calls_per_step": r["calls"] / steps,
                "tottime_us": 1e6 * r["tottime"] / steps,
                "cumtime_us": 1e6 * r["cumtime"] / steps,
            }
            for r in best
        ]

    return {
        "steps": steps,
        "wall_us_per_step": 1e6 * wall / steps,
        "by_tottime": per_step("tottime"),
        "by_cumtime": per_step("cumtime"),
    }


def request_steps(llm: LLM, prompt: Any, params: Any, name: str) -> Callable[[], int]:
    """A `run` for `host_profile`: one request added and stepped to its end; the number of steps."""

    def run() -> int:
        engine = llm.engine
        engine.add(engine.process_inputs(f"{name}-{time.monotonic_ns()}", prompt, params))
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return steps

    return run


def graph_launch(llm: LLM, keys: Iterable[Any], repeats: int = 30) -> dict[str, dict[str, float]]:
    """For each captured graph key (a `GraphChoice`): medians over `repeats` replays of the launch call's host
    time, the wall time from the call to the device's end, and the device time between events around it (us).
    The staging buffers are set to padding first, so the replays write nothing to the cache."""
    runner = llm.engine.runner
    st = runner._staging  # noqa: SLF001 - a benchmark's look inside the runner
    st.g_small[2].fill_(-1)
    st.g_small[3].zero_()
    st.m_tok[2].fill_(-1)
    st.m_seq[:2].zero_()
    out: dict[str, dict[str, float]] = {}
    for key in keys:
        if key not in runner._graphs:  # noqa: SLF001
            continue
        graph, _ = runner._graphs[key]  # noqa: SLF001
        launch, wall, device = [], [], []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            a.record()
            graph.replay()
            b.record()
            t1 = time.perf_counter()
            b.synchronize()
            t2 = time.perf_counter()
            launch.append(t1 - t0)
            wall.append(t2 - t0)
            device.append(a.elapsed_time(b) * 1e-3)
        name = f"decode_bs{key.batch_size}" if key.batch_size else f"mixed_{key.num_tokens}_tokens"
        out[name] = {
            "launch_us": 1e6 * float(np.median(launch)),
            "wall_us": 1e6 * float(np.median(wall)),
            "device_us": 1e6 * float(np.median(device)),
        }
    return out


def print_host_profile(label: str, prof: dict[str, Any], rows: int = 15) -> None:
    """The profile's longest functions, by own time and with callees."""
    print(
        f"host profile, {label}: {prof['steps']} steps, {prof['wall_us_per_step']:.0f} us a step (profiled)"
    )
    for key in ("by_tottime", "by_cumtime"):
        print(f"  {key}:")
        for r in prof[key][:rows]:
            print(
                f"    {r['tottime_us']:8.1f} own {r['cumtime_us']:8.1f} cum us {r['calls_per_step']:6.1f}x"
                f"  {r['function'][:100]}"
            )
