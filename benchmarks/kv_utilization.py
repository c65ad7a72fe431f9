"""KV cache memory: the fraction of allocated KV slots that hold real tokens at peak load.

The paper's figure: a paged cache wastes at most one partly filled block per sequence, so well over 96% of
the allocated slots hold tokens; a system that reserves each request's maximum length up front (Orca-style)
wastes most of it. This script runs a workload through the real engine with a KV cache small enough to stay
full, reads the slots in use and the tokens they hold from every step's StepStats, and sets them beside what
reservation would have used for the same running sequences.

    .venv/bin/python benchmarks/kv_utilization.py [--requests 48] [--blocks 160] [--block-size 16]
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from pathlib import Path

from common import run_steps, write_json

from tinypaged import LLM, SamplingParams
from tinypaged.core.sequence import SequenceStatus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--blocks", type=int, default=160, help="KV blocks (small, so the cache stays full)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_utilization-cpu.json"))
    args = ap.parse_args()

    kwargs = {"model": args.model} if args.model else {}
    llm = LLM(**kwargs, num_gpu_blocks_override=args.blocks, block_size=args.block_size, max_num_seqs=256)
    engine = llm.engine
    rng = random.Random(args.seed)
    vocab = engine.config.model_config.vocab_size
    max_len = {}
    for i in range(args.requests):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 256))]
        out_len = rng.randint(16, 128)
        engine.add_request(
            str(i), {"prompt_token_ids": prompt}, SamplingParams(max_tokens=out_len, ignore_eos=True)
        )
        max_len[str(i)] = len(prompt) + out_len

    def running(request_id: str) -> bool:
        group = engine.scheduler.get_seq_group(request_id)
        return group is not None and bool(group.get_seqs(SequenceStatus.RUNNING))

    num_blocks = engine.stats().num_gpu_blocks
    samples = []  # per step: blocks in use, tokens they hold, slots reservation would hold
    start = time.perf_counter()
    for result in run_steps(llm, time_device=False):
        blocks = num_blocks - result.stats.num_free_blocks
        if blocks:
            reserved = sum(n for rid, n in max_len.items() if running(rid))
            samples.append((blocks, result.stats.num_kv_tokens, reserved))
    elapsed = time.perf_counter() - start

    peak_blocks = max(b for b, _, _ in samples)
    at_peak = [(b, t, r) for b, t, r in samples if b >= 0.9 * peak_blocks]
    slots = sum(b for b, _, _ in at_peak) * args.block_size
    used = sum(t for _, t, _ in at_peak)
    reserved = sum(r for _, _, r in at_peak)
    worst = min(t / (b * args.block_size) for b, t, _ in at_peak)
    result = {
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()}), CPU",
        "date": time.strftime("%Y-%m-%d"),
        "requests": args.requests,
        "kv_blocks": args.blocks,
        "block_size": args.block_size,
        "steps": len(samples),
        "steps_at_peak": len(at_peak),
        "preemptions": engine.stats().num_preemptions,
        "peak_blocks_in_use": peak_blocks,
        "slot_utilization_at_peak": used / slots,
        "worst_step_utilization_at_peak": worst,
        "reservation_utilization_same_sequences": used / reserved,
        "seconds": elapsed,
    }
    write_json(args.out, result)
    print(f"{'metric':<48} value")
    for k in ("steps_at_peak", "preemptions", "peak_blocks_in_use"):
        print(f"{k:<48} {result[k]}")
    print(f"{'KV slots holding real tokens at peak (paged)':<48} {result['slot_utilization_at_peak']:.2%}")
    print(f"{'worst single step at peak (paged)':<48} {worst:.2%}")
    print(
        f"{'same sequences, max length reserved up front':<48} {result['reservation_utilization_same_sequences']:.2%}"
    )


if __name__ == "__main__":
    main()
