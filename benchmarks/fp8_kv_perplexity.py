"""What an FP8 KV cache costs in accuracy on the default model's real weights (CPU, f32 weights), against f32.

Two engines one after the other, the KV cache the only difference: `kv_cache_dtype="auto"` (f32) and "fp8" (E4M3,
per-layer scales: the checkpoint has none, so calibrated at startup). Each scores the same text teacher-forced
(prompt logprobs) in windows of `--window` tokens; printed: the perplexity of each, and the per-token logprob
error of FP8 against f32 (mean, p99 and max of |difference|).

    PYTHONPATH=. python benchmarks/fp8_kv_perplexity.py [--tokens 20480] [--window 2048]

The text is CPython's own `pydoc_data.topics` (the language reference's topics, the text of `help()`): real
English, over 400k tokens of it, that every Python ships; its first `--tokens` tokens in sorted topic order.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pydoc_data import topics

from tinypaged import LLM, SamplingParams


def _logprobs(kv_cache_dtype: str, tokens: int, window: int) -> list[float]:
    llm = LLM(kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = llm.engine.tokenizer.encode(text)[:tokens]
    windows = [ids[i : i + window] for i in range(0, len(ids), window)]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params)
    return [
        entry[tok].logprob
        for w, out in zip(windows, outs, strict=True)
        for tok, entry in zip(w[1:], out.prompt_logprobs[1:], strict=True)
    ]


def main() -> None:
    """Score the text with both caches and print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=20480)
    ap.add_argument("--window", type=int, default=2048)
    args = ap.parse_args()
    runs = {}
    for kv in ("auto", "fp8"):
        t0 = time.perf_counter()
        runs[kv] = _logprobs(kv, args.tokens, args.window)
        ppl = math.exp(-statistics.fmean(runs[kv]))
        print(
            f"{kv:5s} {len(runs[kv])} tokens scored: perplexity {ppl:.4f} ({time.perf_counter() - t0:.0f} s)"
        )
    ref, fp8 = runs["auto"], runs["fp8"]
    diff = sorted(abs(a - b) for a, b in zip(fp8, ref, strict=True))
    ratio = math.exp(statistics.fmean(ref) - statistics.fmean(fp8))
    print(
        f"fp8 against f32: perplexity {100 * (ratio - 1):+.2f}%, |d logprob| mean {statistics.fmean(diff):.4f}, "
        f"p99 {diff[int(0.99 * len(diff))]:.3f}, max {diff[-1]:.3f}"
    )


if __name__ == "__main__":
    main()
