"""Serving the default model on the CPU: tinypaged's batched throughput beside HF transformers' `generate()`
one request at a time, on the same prompts, in one run.

    .venv/bin/python benchmarks/cpu_throughput.py [--requests 32] [--hf-requests 32]

Workload (BENCHMARKS.md, "Targets"): 32 requests, prompts of 32-256 random token ids, outputs of 16-128 tokens
(EOS ignored), greedy, seed 1. HF runs from the same converted checkpoint in float32 with its KV cache.
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from pathlib import Path

import torch
from common import greedy, load_hf, write_json

from tinypaged import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--hf-requests", type=int, default=None, help="run HF on the first N requests only")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_throughput.json"))
    args = ap.parse_args()

    llm = LLM(**({"model": args.model} if args.model else {}))
    model_dir = llm.config.model_config.path
    rng = random.Random(args.seed)
    vocab = llm.config.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 256))] for _ in range(args.requests)]
    out_lens = [rng.randint(16, 128) for _ in prompts]
    params = [greedy(n) for n in out_lens]

    llm.generate({"prompt_token_ids": prompts[0][:8]}, SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ours_s = time.perf_counter() - start
    ours_tokens = sum(len(o.outputs[0].token_ids) for o in outs)

    hf = load_hf(model_dir, torch.float32)
    n_hf = args.hf_requests or args.requests
    hf_tokens, same = 0, 0
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        for p, n, o in zip(prompts[:n_hf], out_lens[:n_hf], outs[:n_hf], strict=True):
            ids = hf.generate(
                torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )[0, len(p) :].tolist()
            hf_tokens += len(ids)
            same += ids == o.outputs[0].token_ids
        hf_s = time.perf_counter() - start

    result = {
        "machine": f"{platform.node()} ({platform.machine()}), {torch.get_num_threads()} torch threads, CPU",
        "date": time.strftime("%Y-%m-%d"),
        "requests": args.requests,
        "hf_requests": n_hf,
        "ours": {
            "seconds": ours_s,
            "output_tokens": ours_tokens,
            "output_tokens_per_s": ours_tokens / ours_s,
        },
        "hf_one_at_a_time": {
            "seconds": hf_s,
            "output_tokens": hf_tokens,
            "output_tokens_per_s": hf_tokens / hf_s,
        },
        "speedup": (ours_tokens / ours_s) / (hf_tokens / hf_s),
        "identical_greedy_outputs": f"{same}/{n_hf}",
    }
    write_json(args.out, result)
    print(f"{'':34} {'output tok/s':>12} {'seconds':>8}")
    print(
        f"{'tinypaged, all requests batched':34} {result['ours']['output_tokens_per_s']:12.1f} {ours_s:8.1f}"
    )
    hf_row = result["hf_one_at_a_time"]
    print(f"{'HF generate(), one at a time':34} {hf_row['output_tokens_per_s']:12.1f} {hf_s:8.1f}")
    print(f"speed-up {result['speedup']:.1f}x; identical greedy outputs {same}/{n_hf}")


if __name__ == "__main__":
    main()
