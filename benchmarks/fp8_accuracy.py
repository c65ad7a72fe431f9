"""What FP8 weights cost in accuracy on the default model's real weights (CPU), measured against f32.

Three engines on the same model, one after the other: f32 (the reference), `quantization="fp8"` (E4M3 weights per
output channel, activations per token, the emulation the GPU kernels will match) and bf16 (for scale: the error
every GPU run already accepts). Printed for each: the per-token logprob error of the text's tokens against f32
(teacher-forced: the prompt logprob of each actual next token; mean, p99 and max of |difference|), the
perplexity of the text, and greedy agreement with f32 over the prompts (identical continuations, and the mean
share of tokens before the first difference).

    PYTHONPATH=. python benchmarks/fp8_accuracy.py [--max-tokens 32] [--text-tokens 1024] \\
        [--json benchmarks/results/fp8_accuracy.json]

The text is the Python standard library's own `this` module (the Zen of Python) and the docstrings of a few
standard modules: real English that every Python ships.
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import statistics
import time

from tinypaged import LLM, SamplingParams

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
]


def _text() -> str:
    """Real English shipped with Python: the Zen of Python (rot13 in `this`) and some standard docstrings."""
    import argparse as a
    import collections
    import contextlib
    import io
    import json as j
    import logging

    with contextlib.redirect_stdout(
        io.StringIO()
    ):  # importing `this` prints the Zen; its `s` is the rot13 source
        import this
    zen = codecs.decode(this.s, "rot13")
    return "\n\n".join(
        [zen, a.__doc__ or "", collections.__doc__ or "", j.__doc__ or "", logging.__doc__ or ""]
    )


def _measure(llm: LLM, text_ids: list[int], max_tokens: int) -> tuple[list[float], list[list[int]]]:
    """The text's per-token logprobs (teacher-forced) and the greedy continuations of PROMPTS."""
    scored = llm.generate(
        [{"prompt_token_ids": text_ids}], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    )[0]
    logprobs = [
        entry[tok].logprob for tok, entry in zip(text_ids[1:], scored.prompt_logprobs[1:], strict=True)
    ]
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return logprobs, [list(o.outputs[0].token_ids) for o in greedy]


def main() -> None:
    """Run the three engines and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--text-tokens", type=int, default=1024, help="tokens of the text scored")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args()
    runs = {"f32": {"dtype": "float32"}, "fp8": {"dtype": "float32", "quantization": "fp8"}}
    runs["bf16"] = {"dtype": "bfloat16"}
    results = {}
    for name, kwargs in runs.items():
        t0 = time.perf_counter()
        with LLM(**kwargs) as llm:
            ids = llm.get_tokenizer().encode(_text())[: args.text_tokens]
            results[name] = _measure(llm, ids, args.max_tokens)
        print(f"{name}: measured in {time.perf_counter() - t0:.0f} s", flush=True)
    ref_lp, ref_greedy = results["f32"]
    rows = {}
    for name, (lp, greedy) in results.items():
        err = sorted(abs(a - b) for a, b in zip(lp, ref_lp, strict=True))
        prefix = []
        for got, want in zip(greedy, ref_greedy, strict=True):
            same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want))
            prefix.append(same / len(want))
        rows[name] = {
            "tokens": len(lp),
            "ppl": math.exp(-statistics.fmean(lp)),
            "logprob_err_mean": statistics.fmean(err),
            "logprob_err_p99": err[int(0.99 * (len(err) - 1))],
            "logprob_err_max": err[-1],
            "greedy_identical": sum(g == w for g, w in zip(greedy, ref_greedy, strict=True)),
            "greedy_prompts": len(PROMPTS),
            "greedy_prefix_share": statistics.fmean(prefix),
        }
    print(
        f"\ndefault model, {rows['f32']['tokens']} text tokens, {len(PROMPTS)} prompts x {args.max_tokens} greedy"
    )
    print(
        f"{'weights':8} {'ppl':>8} {'|dlogp| mean':>13} {'p99':>8} {'max':>8} {'greedy same':>12} {'prefix':>7}"
    )
    for name, r in rows.items():
        print(
            f"{name:8} {r['ppl']:8.3f} {r['logprob_err_mean']:13.5f} {r['logprob_err_p99']:8.4f} "
            f"{r['logprob_err_max']:8.4f} {r['greedy_identical']:>6}/{r['greedy_prompts']:<5} "
            f"{r['greedy_prefix_share']:7.1%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"max_tokens": args.max_tokens, "runs": rows}, f, indent=2)


if __name__ == "__main__":
    main()
