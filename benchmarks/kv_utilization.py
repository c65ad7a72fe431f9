"""KV cache memory: the fraction of allocated KV slots that hold real tokens at peak load.

The paper's figure: a paged cache wastes at most one partly filled block per sequence, so well over 96% of
the allocated slots hold tokens; a system that reserves each request's maximum length up front (Orca-style)
wastes most of it. This script runs a workload through the real engine with a KV cache small enough to stay
full, measures slot utilisation after every step, and sets it beside what reservation would have used for
the same running sequences.

    .venv/bin/python benchmarks/kv_utilization.py [--requests 48] [--blocks 160] [--block-size 16]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

from tinypaged import LLM, SamplingParams


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
    engine, kv, sched = llm.engine, llm.engine.kv, llm.engine.scheduler
    rng = random.Random(args.seed)
    vocab = engine.config.model.vocab_size
    max_len = {}
    for i in range(args.requests):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 256))]
        out_len = rng.randint(16, 128)
        engine.add_request(
            str(i), {"prompt_token_ids": prompt}, SamplingParams(max_tokens=out_len, ignore_eos=True)
        )
        max_len[str(i)] = len(prompt) + out_len

    samples = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        blocks: set[int] = set()
        tokens = reserved = 0
        for group in sched.running:
            for seq in group.seqs:
                if seq.status.is_finished:
                    continue
                table = kv.get_block_table(seq.seq_id)
                blocks.update(table)
                tokens += seq.num_computed_tokens
            reserved += max_len[group.request_id]
        if blocks:
            samples.append((len(blocks), tokens, reserved))
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
        "preemptions": sched.num_preemptions,
        "peak_blocks_in_use": peak_blocks,
        "slot_utilization_at_peak": used / slots,
        "worst_step_utilization_at_peak": worst,
        "reservation_utilization_same_sequences": used / reserved,
        "seconds": elapsed,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
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
