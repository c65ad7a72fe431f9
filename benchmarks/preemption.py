"""Outputs under forced preemption on the GPU: the same requests with ample KV blocks, then with too few blocks
for them all, preempting by swapping to CPU memory and by recomputation.

The CPU suite proves preemption changes no output; the GPU adds what the CPU lacks: copies between the device
and pinned host memory that run asynchronously, CUDA graphs and async scheduling. A preempted run also changes
the batches, hence the kernels and their rounding. In float32 that is far below the random model's top-2 logit
gaps, so greedy tokens must match exactly: the check (exit status 1 if not). The rest is information: bfloat16
greedy tokens part at near-ties, and seeded sampling draws over ~100K near-equal probabilities, where
rounding-level differences move the draw.

    tinypaged weights random --config llama-3.2-1b --out /tmp/m1b
    python3 benchmarks/preemption.py --model /tmp/m1b --out benchmarks/results/preemption-h200.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import device_name, free_llm, greedy, random_prompt, write_json

from tinypaged import LLM, SamplingParams

MODES = {
    "ample": {},
    "swap": {"preemption_mode": "swap"},
    "recompute": {"preemption_mode": "recompute"},
}


def run(
    model: str, dtype: str, blocks: int | None, mode: dict, prompts: list, params: dict
) -> dict[str, Any]:
    """Token ids of every request under each kind of sampling params, and the preemptions it took."""
    llm = LLM(model=model, max_model_len=1024, dtype=dtype, num_gpu_blocks_override=blocks, **mode)
    try:
        out: dict[str, Any] = {
            kind: [o.outputs[0].token_ids for o in llm.generate(prompts, p)] for kind, p in params.items()
        }
        out["preemptions"] = llm.engine.stats().num_preemptions
        return out
    finally:
        free_llm(llm)


def main() -> None:
    """Run every dtype and kind of preemption, print the table, write the JSON; fail if float32 greedy moved."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=160, help="KV blocks of the preempted runs")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    prompts = [random_prompt(rng, int(rng.integers(20, 300)), 32000) for _ in range(args.requests)]
    params = {
        "greedy": greedy(args.max_tokens),
        "sampled": [
            SamplingParams(
                temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=args.max_tokens, ignore_eos=True
            )
            for i in range(args.requests)
        ],
    }
    results: dict[str, Any] = {"device": device_name(), "torch": torch.__version__, "args": vars(args)}
    lines = [
        "| dtype | preemption | preemptions | greedy equal to ample | sampled equal to ample |",
        "|---|---|---|---|---|",
    ]
    for dtype in ("float32", "bfloat16"):
        runs = {
            name: run(args.model, dtype, None if name == "ample" else args.blocks, mode, prompts, params)
            for name, mode in MODES.items()
        }
        for name in ("swap", "recompute"):
            same = {
                kind: sum(a == b for a, b in zip(runs[name][kind], runs["ample"][kind], strict=True))
                for kind in params
            }
            results[f"{dtype}-{name}"] = {"preemptions": runs[name]["preemptions"], "equal_to_ample": same}
            lines.append(
                f"| {dtype} | {name} | {runs[name]['preemptions']} | {same['greedy']} of {args.requests} | "
                f"{same['sampled']} of {args.requests} |"
            )
        results[dtype] = runs
        print(lines[-2], lines[-1], sep="\n", flush=True)
    results["table"] = "\n".join(lines)
    failed = [
        m
        for m in ("swap", "recompute")
        if results[f"float32-{m}"]["equal_to_ample"]["greedy"] != args.requests
    ]
    results["float32_greedy_unchanged"] = not failed
    if args.out:
        write_json(args.out, results)
    print("\n" + results["table"])
    if failed:
        raise SystemExit(f"float32 greedy outputs changed under preemption by {', '.join(failed)}")


if __name__ == "__main__":
    main()
