"""Engine overhead: time per decode step in Python (schedule, prepare inputs, sample, update) vs the model.

Runs B requests (short random prompts, ignore EOS) on the default model until every one is decoding, then
times `--steps` decode steps with the engine's parts wrapped in timers: the scheduler's schedule(), the
runner's input preparation and block moves, the model forward (+ logits), the sampler, and the rest of the
step's output processing (update_from_output, appending tokens, stop checks, detokenization,
building RequestOutputs).

    .venv/bin/python benchmarks/engine_overhead.py [--batches 1 32 256] [--steps 8]
        [--out benchmarks/results/engine_overhead-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tinypaged import LLM, SamplingParams

PARTS = ("schedule", "prepare", "forward", "sample", "update")


def timed(fn: Callable[..., Any], name: str, acc: dict[str, float]) -> Callable[..., Any]:
    """Wrap fn so that its wall time adds to acc[name]."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t0

    return wrapper


def measure(llm: LLM, batch: int, steps: int, prompt_len: int, seed: int) -> dict[str, float]:
    """Mean seconds per decode step for each part, at this batch size."""
    engine = llm.engine
    rng = random.Random(seed)
    vocab = engine.config.model.vocab_size
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        ids = [rng.randrange(vocab) for _ in range(prompt_len)]
        engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": ids}, params)
    while (
        any(
            s.num_computed_tokens < s.prompt_len
            for g in engine.scheduler.waiting + engine.scheduler.running
            for s in g.seqs
        )
        or engine.scheduler.waiting
    ):
        engine.step()  # prefill (in chunks) until every request decodes
    acc: dict[str, float] = defaultdict(float)
    runner, sched, model = engine.runner, engine.scheduler, engine.runner.model
    parts = [
        (sched, "schedule", "schedule"),
        (runner, "prepare", "prepare"),
        (runner, "move_blocks", "prepare"),
        (model, "forward", "forward"),
        (model, "compute_logits", "forward"),
        (engine.sampler, "sample", "sample"),
        (engine, "_sample", "process"),  # builds the sampling rows, then calls the sampler
        (engine, "_apply", "process"),
        (sched, "update_from_output", "update"),
    ]
    for obj, attr, name in parts:
        setattr(obj, attr, timed(getattr(obj, attr), name, acc))
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - t0
    for obj, attr, _ in parts:
        delattr(obj, attr)  # the class's method again
    for rid in list(engine.requests):
        engine.abort_request(rid)
    acc["update"] += acc.pop("process") - acc["sample"]  # output processing without the sampler itself
    per_step = {k: acc[k] / steps for k in PARTS}
    per_step["other"] = total / steps - sum(per_step.values())
    per_step["total"] = total / steps
    return per_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_overhead-cpu.json"))
    args = ap.parse_args()

    kwargs = {"model": args.model} if args.model else {}
    llm = LLM(**kwargs, max_num_seqs=max(args.batches), max_num_batched_tokens=4096, max_model_len=512)
    rows = {b: measure(llm, b, args.steps, args.prompt_len, args.seed) for b in args.batches}
    print(f"ms per decode step on {platform.machine()} ({torch.get_num_threads()} torch threads)")
    print(f"{'batch':>6}" + "".join(f"{p:>10}" for p in (*PARTS, "other", "total")) + f"{'python %':>10}")
    for b, r in rows.items():
        python = r["total"] - r["forward"]
        print(
            f"{b:>6}"
            + "".join(f"{r[p] * 1e3:>10.2f}" for p in (*PARTS, "other", "total"))
            + f"{python / r['total']:>10.1%}"
        )
    result = {
        "benchmark": "engine_overhead",
        "platform": platform.platform(),
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "steps": args.steps,
        "prompt_len": args.prompt_len,
        "seconds_per_step": {str(b): r for b, r in rows.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
