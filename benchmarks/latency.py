"""Batch-1 latency on one GPU: decode tokens/s with and without CUDA graphs against the bandwidth roofline,
and the time to first token of a 1024-token prompt. `--check` adds the GPU numerics checks: greedy tokens of
the Triton path against the torch-reference path (bf16, and float32 where rounding cannot flip near-ties),
and prompt logits of both and of HF transformers in bf16 against HF transformers in float32.

    tinypaged weights random --config llama-3.1-8b --out /tmp/llama-3.1-8b
    python benchmarks/latency.py --model /tmp/llama-3.1-8b --check --out benchmarks/results/latency-h200.json

Everything goes through the engine's own step (scheduler, runner, sampler), with random prompt token ids; the
per-step device and host times come from its StepStats. The measurements live in `common.py`, which
`benchmarks/throughput.py --latency --check` runs on its engine, in the same process.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    device_name,
    fp32_greedy_check,
    free_llm,
    greedy,
    hf_checks,
    profile_steps,
    random_prompt,
    run_checks,
    run_latency,
    write_json,
)
from host_time import host_profile, print_host_profile, request_steps

from tinypaged import LLM


def profile_batch1(llm: LLM, prompt_len: int, steps: int = 32, seed: int = 3) -> dict[str, Any]:
    """torch.profiler over `steps` batch-1 decode steps (with CUDA graphs when the engine has them)."""
    engine = llm.engine
    rng = np.random.default_rng(seed)
    engine.add_request(
        "prof-b1", random_prompt(rng, prompt_len, llm.config.model_config.vocab_size), greedy(steps + 8)
    )
    for _ in range(4):
        engine.step()
    table = profile_steps(llm, steps)
    engine.abort_request("prof-b1")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--check", action="store_true", help="numerics: Triton vs torch reference vs HF")
    ap.add_argument("--profile", action="store_true", help="kernel time of batch-1 decode steps (graphs)")
    ap.add_argument(
        "--host-profile", action="store_true", help="cProfile of batch-1 decode steps (host_time.py)"
    )
    ap.add_argument("--quantization", default=None, help="e.g. fp8, int4, int8 (the engine's setting)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    llm = LLM(
        model=args.model, max_model_len=args.max_model_len, max_num_seqs=16, quantization=args.quantization
    )
    result: dict[str, Any] = {
        "model": args.model,
        "quantization": args.quantization,
        "device": device_name(),
    }
    if args.check:
        result["check"], state = run_checks(llm)
    result["latency"] = run_latency(llm, args.prompt_len, args.gen_tokens)
    if args.profile:
        result["profile_batch1"] = profile_batch1(llm, args.prompt_len)
    if args.host_profile:
        rng = np.random.default_rng(5)
        prompt = random_prompt(rng, args.prompt_len, llm.config.model_config.vocab_size)
        run = request_steps(llm, prompt, greedy(args.gen_tokens), "hprof")
        result["host_profile"] = host_profile(llm, run)
    if args.check:
        free_llm(llm)
        result["check_fp32"] = fp32_greedy_check(args.model)
        result["check_hf"] = hf_checks(args.model, state)
    print(json.dumps(result, indent=1))
    lat = result["latency"]
    for m in ("graphs", "graphs_sync", "eager"):
        if m in lat:
            print(
                f"batch-1 decode {m}: {lat[m]['decode_tokens_per_s']:.1f} tok/s "
                f"({lat[m]['fraction_of_roofline']:.0%} of {lat['roofline_decode_tokens_per_s']:.0f}), "
                f"GPU {lat[m]['runner_gpu_ms_per_step']:.2f} ms + "
                f"host {lat[m]['host_ms_per_step']:.2f} ms/step"
            )
    if "profile_batch1" in result:
        w = result["profile_batch1"]
        print(
            f"profile batch-1: {1e3 * w['wall_s'] / w['steps']:.2f} ms/step wall, "
            f"{1e3 * w['gpu_kernel_s'] / w['steps']:.2f} ms/step kernels; by class (ms/step): "
            + ", ".join(f"{k} {1e3 * v / w['steps']:.3f}" for k, v in w["by_class_s"].items())
        )
        for k, t in w["top_kernels_s"][:8]:
            print(f"  {1e3 * t / w['steps']:.3f} ms/step  {k}")
    if "host_profile" in result:
        print_host_profile("batch-1 decode", result["host_profile"])
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
