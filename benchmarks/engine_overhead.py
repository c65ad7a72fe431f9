"""Engine overhead: time per decode step in each phase of `LLMEngine.step()`, from the StepStats it returns.

Runs B requests (short random prompts, EOS ignored, temperature 0.8, top-p 0.95) on the default model until
every one is decoding, then reads `--steps` decode steps' statistics: schedule; execute (block moves, input
staging, the forward pass and logits, and the scheduler's bookkeeping; on the CPU the forward pass runs here);
sample (each request's sampling rows and the sampler pass); update (applying tokens: appends, stop checks,
detokenization, building RequestOutputs: `--output-kind final_only`, LLM.generate's, builds none until a
request finishes and detokenizes only then), of which wait (for sampled tokens to reach the host). The four
phases add up to the whole call. Beside them, the sampler alone (`Sampler.sample`, its public API) on random
logits of the same shape: flat distributions, as random prompt ids give, where top-p sorts the whole
vocabulary.

    .venv/bin/python benchmarks/engine_overhead.py [--batches 1 32 256] [--steps 8]
        [--output-kind cumulative|final_only] [--out benchmarks/results/engine_overhead-cpu.json]
"""

from __future__ import annotations

import argparse
import itertools
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch
from common import PHASES, run_steps, write_json

from tinypaged import LLM, RequestOutputKind, SamplingParams
from tinypaged.engine.sampling.sampler import Sampler, SamplingRow

COLUMNS = (*PHASES, "total")


def measure(
    llm: LLM, batch: int, steps: int, prompt_len: int, seed: int, kind: RequestOutputKind
) -> dict[str, float]:
    """Mean seconds per decode step in each phase, at this batch size."""
    engine = llm.engine
    rng = random.Random(seed)
    vocab = engine.config.model_config.vocab_size
    for i in range(batch):
        ids = [rng.randrange(vocab) for _ in range(prompt_len)]
        engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": ids}, sampling_params(steps, kind))
    loop = (result.stats for result in run_steps(llm, time_device=False))
    for st in loop:  # prefill (in chunks) until a step decodes every request
        if st.num_seqs == batch and not st.num_prefill_tokens:
            break
    timed = list(itertools.islice(loop, steps))
    loop.close()
    engine.abort_all()
    assert len(timed) == steps and all(s.num_seqs == batch and not s.num_prefill_tokens for s in timed)
    per_step = {p: sum(getattr(s, f"{p}_s") for s in timed) / steps for p in PHASES}
    per_step["total"] = sum(s.total_s for s in timed) / steps
    return per_step


def sampling_params(steps: int, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> SamplingParams:
    """What every request samples with: enough tokens for the prefill, one warm decode step and the timed ones."""
    return SamplingParams(
        temperature=0.8, top_p=0.95, max_tokens=steps + 4, ignore_eos=True, output_kind=kind
    )


def time_sampler(llm: LLM, batch: int, steps: int, seed: int) -> float:
    """Mean seconds of one `Sampler.sample` pass (result read back) over random logits `[batch, vocab]`."""
    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, llm.config.model_config.vocab_size, generator=gen).to(
        runner.device, runner.dtype
    )
    rows = [SamplingRow(sampling_params(steps), [], []) for _ in range(batch)]
    sampler = Sampler()
    sampler.sample(logits, rows).result()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        sampler.sample(logits, rows).result()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--output-kind", choices=["cumulative", "final_only"], default="cumulative")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_overhead-cpu.json"))
    args = ap.parse_args()

    kwargs = {"model": args.model} if args.model else {}
    kind = RequestOutputKind[args.output_kind.upper()]
    llm = LLM(**kwargs, max_num_seqs=max(args.batches), max_num_batched_tokens=4096, max_model_len=512)
    rows: dict[int, dict[str, Any]] = {}
    for b in args.batches:
        rows[b] = measure(llm, b, args.steps, args.prompt_len, args.seed, kind)
        rows[b]["sampler_alone"] = time_sampler(llm, b, args.steps, args.seed)
    print(f"ms per decode step on {platform.machine()} ({torch.get_num_threads()} torch threads)")
    names = (*COLUMNS, "sampler only", "not execute")
    print(f"{'batch':>6}" + "".join(f"{c:>13}" for c in names))
    for b, r in rows.items():
        print(
            f"{b:>6}"
            + "".join(f"{r[c] * 1e3:>13.2f}" for c in COLUMNS)
            + f"{r['sampler_alone'] * 1e3:>13.2f}"
            + f"{1 - r['execute'] / r['total']:>13.1%}"
        )
    result = {
        "benchmark": "engine_overhead",
        "platform": platform.platform(),
        "device": str(llm.engine.runner.device),
        "torch_threads": torch.get_num_threads(),
        "steps": args.steps,
        "prompt_len": args.prompt_len,
        "output_kind": args.output_kind,
        "seconds_per_step": {str(b): r for b, r in rows.items()},
    }
    write_json(args.out, result)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
