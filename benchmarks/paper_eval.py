"""The vLLM paper's evaluation (Kwon et al., SOSP 2023, sections 6-7) on this engine: normalized latency against
request rate on the ShareGPT and Alpaca shapes, the highest rate sustained under a latency bound, KV usage and
batch size over time, memory saved by sharing (parallel sampling and beam search), and end-to-end latency against
block size; with `--kernels` on a GPU, the paged attention kernel against SDPA on a contiguous cache and over
every block size (paper_kernels.py).

    python benchmarks/paper_eval.py --smoke --json /tmp/paper-cpu.json            # CPU: seconds, default model
    tinypaged weights random --config llama-3.1-8b --out /tmp/llama-3.1-8b
    python benchmarks/paper_eval.py --model /tmp/llama-3.1-8b --sections rates \\
        --json benchmarks/results/paper-rates-h200.json                          # then: sharing, block_sizes

Serving under arrivals: the requests (workload shapes: paper_workloads.py) are checked and tokenized first,
then queued into the engine at their Poisson arrival times while one loop runs `LLMEngine.step()`, as a server's
engine loop does, without HTTP in the way; a request's latency runs from its arrival to the step that returned
its final output, and its normalized latency is that over its output tokens (the paper's measure: the mean of
it over the requests). Every step's StepStats gives the batch (sequences in the forward pass), the KV blocks in
use and the tokens they hold, over time. A rate is sustained while the mean normalized latency stays under the
bound: `--latency-bound` seconds a token, or by default `--bound-factor` (2) times the lowest rate's. Without
`--rates`, the rates are fractions of the throughput the same requests reach all sent at once (measured first),
so the sweep finds the knee on any machine.

Sharing: the Alpaca shape with n = 2, 4, 6 parallel samples and beam width 2, 4, 6, all sent at once with room
for every sequence, against the same requests as independent single sequences (the copies a system without
sharing holds); the prefix cache is off throughout (it would share the copies' prompts). Measured: the peak KV
blocks in use and block-steps (blocks summed over steps: memory held over time), from the steps' StepStats
(sharing.py's `run`).

Reservation policies (the paper's Orca baselines) come with the engine option `kv_reservation` ("paged", the
default and today's behaviour; "orca-oracle", "orca-pow2", "orca-max"): `--policies` lists the ones to run, each
on its own engine built with `kv_reservation=POLICY`; until the engine has that option only "paged" runs and the
others are recorded as unavailable. The interface they plug into: docs/paper-eval.md.

One job, past 450 lines: the paper's serving experiments (rates, sharing, block sizes) run the same engine loop
into one result file and one table; the workload shapes (paper_workloads.py) and the kernel timings
(paper_kernels.py) live apart, as they need no engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from common import free_llm, header, section, write_json
from paper_workloads import PAPER_MAX_LEN, Workload, file_workload, paper_workload, poisson_arrivals
from sharing import run as run_sharing

from tinypaged import LLM, SamplingParams
from tinypaged.config import EngineConfig
from tinypaged.sampling_params import RequestOutputKind

POLICIES = ("paged", "orca-oracle", "orca-pow2", "orca-max")
SECTIONS = ("rates", "sharing", "block_sizes", "kernels")
RATE_FRACTIONS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25)  # of the all-at-once throughput
SERIES_POINTS = 400  # steps kept per run for the over-time plots (evenly spaced)
# The paper's OPT-13B shape as a Llama with multi-head attention (40 KV heads): what a paper-pressure run
# loads (`--random-shape llama-13b-mha`), with the KV cache capped to the paper's capacity (`--kv-tokens`).
LLAMA_13B_MHA = {
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "num_key_value_heads": 40,
    "head_dim": 128,
    "vocab_size": 32000,
    "bos_token_id": 31998,  # inside the vocabulary (the 8B preset's ids are not), past the byte tokens
    "eos_token_id": 31999,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
}


def policy_supported(policy: str) -> bool:
    """Whether this engine can run `policy`: "paged" always; the others once EngineConfig has `kv_reservation`."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    return policy == "paged" or "kv_reservation" in fields


def engine_args(args: argparse.Namespace, policy: str, block_size: int | None = None) -> dict[str, Any]:
    """LLM(...) arguments of one run: the paper's setting (max_model_len 2048, no prefix cache) and the policy."""
    block_size = block_size or args.block_size
    kw: dict[str, Any] = {
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": block_size,
        "enable_prefix_caching": False,
        "seed": args.seed,
    }
    if args.model:
        kw["model"] = args.model
    if args.kv_tokens:  # the same KV capacity in tokens whatever the block size
        kw["num_gpu_blocks_override"] = max(1, args.kv_tokens // block_size)
    if policy != "paged" or "kv_reservation" in {f.name for f in dataclasses.fields(EngineConfig)}:
        kw["kv_reservation"] = policy
    return kw


def load_workload(args: argparse.Namespace, name: str, n: int, seed: int, llm: LLM) -> Workload:
    """`n` requests of the `name` shape: from the dataset file given for it (its texts counted in the model's
    tokens, no special tokens added), or from the paper's fit."""
    path = getattr(args, f"{name}_file")
    if path:
        tok = llm.get_tokenizer()
        return file_workload(
            name, path, lambda text: tok.encode(text, add_special_tokens=False), n, seed, args.max_model_len
        )
    return paper_workload(name, n, seed, args.max_model_len, args.scale)


def serve(llm: LLM, work: Workload, rate: float, seed: int, tag: str) -> dict[str, Any]:
    """Run the requests arriving as a Poisson process at `rate` (inf: all at once) through the engine loop;
    latencies, throughput, and the batch and KV blocks over time."""
    engine = llm.engine
    vocab = llm.config.model_config.vocab_size
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(len(work.prompt_lens), rate, rng)
    reqs = []
    for i, (p, o) in enumerate(zip(work.prompt_lens, work.output_lens, strict=True)):
        params = SamplingParams(
            temperature=0.0, max_tokens=o, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )
        reqs.append(
            engine.process_inputs(
                f"{tag}-{i}", {"prompt_token_ids": rng.integers(0, vocab, p).tolist()}, params
            )
        )
    total = engine.stats().num_gpu_blocks
    preempted0 = engine.stats().num_preemptions
    lat: list[float] = []
    norm: list[float] = []
    errors: list[str] = []
    # (seconds, sequences in the batch, blocks used, KV tokens, reserved-unused slots, internal slots, free
    # blocks outside the largest free extent): StepStats' figures
    series: list[tuple[float, int, int, int, int, int, int]] = []
    start = time.monotonic()
    i = 0
    while i < len(reqs) or engine.has_unfinished_requests():
        now = time.monotonic()
        while i < len(reqs) and start + arrivals[i] <= now:
            engine.add(replace(reqs[i], arrival_time=start + float(arrivals[i])))
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + float(arrivals[i]) - time.monotonic()))
            continue
        result = engine.step()
        now = time.monotonic()
        s = result.stats
        series.append(
            (
                now - start,
                s.num_seqs,
                total - s.num_free_blocks,
                s.num_kv_tokens,
                s.num_reserved_unused_slots,
                s.num_internal_waste_slots,
                s.num_external_free_blocks,
            )
        )
        for out in result.outputs:
            if not out.finished:
                continue
            if out.error:
                errors.append(out.error)
                continue
            arrived = out.metrics.arrival_time if out.metrics else start
            done = out.metrics.finished_time if out.metrics and out.metrics.finished_time else now
            lat.append(done - arrived)
            norm.append((done - arrived) / max(1, len(out.outputs[0].token_ids)))
    makespan = time.monotonic() - start
    return {
        "rate": rate,
        "requests": len(reqs),
        "completed": len(lat),
        "errors": errors[:5],
        "num_errors": len(errors),
        "makespan_s": makespan,
        "throughput_req_s": len(lat) / makespan,
        "throughput_tok_s": sum(work.output_lens) / makespan,
        "mean_latency_s": float(np.mean(lat)) if lat else math.nan,
        "mean_norm_latency_s": float(np.mean(norm)) if norm else math.nan,
        "p50_norm_latency_s": float(np.median(norm)) if norm else math.nan,
        "p99_norm_latency_s": float(np.quantile(norm, 0.99)) if norm else math.nan,
        "preemptions": engine.stats().num_preemptions - preempted0,
        **usage(series, total, llm.config.block_size),
    }


def usage(
    series: list[tuple[float, int, int, int, int, int, int]], total: int, block_size: int
) -> dict[str, Any]:
    """Batch size and KV use over a run's steps: means over the steps that ran, the peak, the slots holding
    tokens at the peak (the paged cache's waste is the rest), the waste at the peak by kind (the held slots
    reserved but not reached, and those of reached blocks not written, over the held slots; the free blocks
    outside the largest free extent over the cache), and the series itself, thinned to SERIES_POINTS."""
    ran = [r for r in series if r[1]]
    if not ran:
        return {"kv_blocks_total": total}
    peak = max(ran, key=lambda r: r[2])
    keep = sorted(set(np.linspace(0, len(series) - 1, min(SERIES_POINTS, len(series))).astype(int).tolist()))
    return {
        "kv_blocks_total": total,
        "mean_batch_seqs": float(np.mean([r[1] for r in ran])),
        "max_batch_seqs": max(r[1] for r in ran),
        "mean_kv_usage": float(np.mean([r[2] for r in ran])) / total,
        "peak_kv_usage": peak[2] / total,
        "peak_slot_utilization": peak[3] / max(1, peak[2] * block_size),
        "peak_waste": {
            "reserved": peak[4] / max(1, peak[2] * block_size),
            "internal": peak[5] / max(1, peak[2] * block_size),
            "external": peak[6] / total,
        },
        "series": {
            "t_s": [round(series[k][0], 4) for k in keep],
            "batch_seqs": [series[k][1] for k in keep],
            "kv_usage": [round(series[k][2] / total, 4) for k in keep],
            "kv_waste": [
                round((series[k][4] + series[k][5]) / max(1, series[k][2] * block_size), 4) for k in keep
            ],
        },
    }


def waste_text(run: dict[str, Any]) -> str:
    """A run's KV waste at its peak of block use: reserved-unused and internal (of the held slots), external (of
    the cache)."""
    w = run.get("peak_waste")
    if not w:
        return "waste n/a"
    return f"waste {w['reserved']:.0%} reserved + {w['internal']:.0%} internal, {w['external']:.0%} external"


def sustained(runs: list[dict[str, Any]], bound: float | None, factor: float) -> dict[str, Any]:
    """The highest rate whose mean normalized latency stays under the bound (seconds a token; default: `factor`
    times the lowest rate's), with the bound used."""
    finite = sorted((r for r in runs if math.isfinite(r["rate"]) and r["completed"]), key=lambda r: r["rate"])
    if not finite:
        return {"bound_s_per_token": bound, "max_rate": None}
    bound = bound if bound is not None else factor * finite[0]["mean_norm_latency_s"]
    ok = [r["rate"] for r in finite if r["mean_norm_latency_s"] <= bound and not r["num_errors"]]
    return {"bound_s_per_token": bound, "max_rate": max(ok) if ok else None}


def rate_sweep(
    llm: LLM, args: argparse.Namespace, name: str, ref: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One workload shape over its rates on one engine: the all-at-once run first (its throughput sets the
    rates when none are given), then each rate; the sustained rate under the bound. With `ref` (another
    policy's sweep of the same workload) the rates and the latency bound are that sweep's, so that policies
    are compared at the same request rates under the same bound."""
    work = load_workload(args, name, args.num_requests, args.seed, llm)
    given = getattr(args, f"{name}_rates")
    saturated = None
    if not (args.skip_saturated and (ref is not None or given)):
        saturated = serve(llm, work, math.inf, args.seed, f"{name}-inf")
    bound = args.latency_bound
    if ref is not None:
        rates = [r["rate"] for r in ref["runs"]]
        bound = ref["sustained"]["bound_s_per_token"]
    else:
        rates = given or [round(f * saturated["throughput_req_s"], 3) for f in RATE_FRACTIONS]
    runs = []
    for k, r in enumerate(sorted(rates)):
        runs.append(serve(llm, work, r, args.seed + k + 1, f"{name}-{k}"))
        over = sustained(runs, bound, args.bound_factor)["max_rate"] != r
        if args.stop_over_bound and over:  # the higher rates would only be further over it
            print(
                f"  {name}: rate {r:.3g} is over the latency bound; the higher rates are skipped", flush=True
            )
            break
    for r in [saturated, *runs] if saturated else runs:
        print(
            f"  {name} rate {r['rate']:>8.3g}: norm latency {1e3 * r['mean_norm_latency_s']:8.2f} ms/token, "
            f"{r['throughput_req_s']:.3g} req/s, batch {r.get('mean_batch_seqs', 0):.1f}, "
            f"peak KV {r.get('peak_kv_usage', 0):.0%} ({waste_text(r)}), preempted {r['preemptions']}",
            flush=True,
        )
    return {
        "workload": work.summary(),
        "saturated": saturated,
        "runs": runs,
        "sustained": sustained(runs, bound, args.bound_factor),
        **({"rates_from": ref.get("policy", "reference")} if ref is not None else {}),
    }


def run_rates(
    args: argparse.Namespace, policy: str, refs: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Every workload's rate sweep under one policy, on one engine; `refs` (workload -> another policy's
    sweep) fixes the rates and the bound where given."""
    llm = LLM(**engine_args(args, policy))
    out: dict[str, Any] = {}
    try:
        for name in args.workloads:
            ref = (refs or {}).get(name)
            section(out, name, lambda n=name, r=ref: rate_sweep(llm, args, n, r))
        return out
    finally:
        free_llm(llm)


def run_sharing_section(args: argparse.Namespace) -> dict[str, Any]:
    """Blocks with sharing against the same requests as independent sequences, for parallel sampling and beam
    search at each width, on the Alpaca shape."""
    widths = args.widths
    kw = engine_args(args, "paged")
    kw["max_num_seqs"] = max(args.max_num_seqs, args.sharing_requests * max(widths))
    llm = LLM(**kw)
    try:
        work = load_workload(args, "alpaca", args.sharing_requests, args.seed, llm)
        rng = np.random.default_rng(args.seed)
        vocab = llm.config.model_config.vocab_size
        prompts = [rng.integers(0, vocab, p).tolist() for p in work.prompt_lens]
        out: dict[str, Any] = {"workload": work.summary()}
        for w in widths:
            for kind in ("parallel_sampling", "beam_search"):
                shared, alone = [], []
                for k, (p, o) in enumerate(zip(prompts, work.output_lens, strict=True)):
                    if kind == "beam_search":
                        shared.append(
                            (
                                p,
                                SamplingParams(
                                    n=w, use_beam_search=True, temperature=0.0, max_tokens=o, ignore_eos=True
                                ),
                            )
                        )
                        alone += [(p, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))] * w
                    else:
                        shared.append(
                            (p, SamplingParams(n=w, temperature=1.0, seed=k, max_tokens=o, ignore_eos=True))
                        )
                        alone += [
                            (
                                p,
                                SamplingParams(
                                    temperature=1.0, seed=k * w + j, max_tokens=o, ignore_eos=True
                                ),
                            )
                            for j in range(w)
                        ]
                a, b = run_sharing(llm, shared), run_sharing(llm, alone)
                row = {
                    "width": w,
                    "shared": a,
                    "independent": b,
                    "saved_peak_blocks": 1 - a["peak_blocks"] / b["peak_blocks"],
                    "saved_block_steps": 1 - a["block_steps"] / b["block_steps"],
                }
                out[f"{kind}_{w}"] = row
                print(
                    f"  {kind} {w}: peak blocks {a['peak_blocks']} vs {b['peak_blocks']} "
                    f"(saved {row['saved_peak_blocks']:.1%}), block-steps saved {row['saved_block_steps']:.1%}",
                    flush=True,
                )
        return out
    finally:
        free_llm(llm)


def run_block_sizes(args: argparse.Namespace, res: dict[str, Any]) -> None:
    """End-to-end normalized latency against block size (the paper's Fig. 18b) into `res["block_sizes"]`: each
    block size on its own engine (the same KV capacity in tokens with `--kv-tokens`), each workload at one
    rate, the JSON written after each size (a run cut short keeps the sizes done); a block size the engine
    refuses is recorded as such and the others still run."""
    out: dict[str, Any] = res.setdefault("block_sizes", {})
    for bs in args.block_sizes:
        section(out, str(bs), lambda bs=bs: block_size_row(args, bs))
        if args.json:
            write_json(args.json, res)


def block_size_row(args: argparse.Namespace, bs: int) -> dict[str, Any]:
    """Every workload at its block-size rate on one engine of block size `bs` (series left out)."""
    llm = LLM(**engine_args(args, "paged", bs))
    row = {}
    try:
        for name in args.workloads:
            count = getattr(args, f"{name}_block_requests") or args.num_requests
            work = load_workload(args, name, count, args.seed, llm)
            rate = getattr(args, f"{name}_block_rate") or math.inf
            run = serve(llm, work, rate, args.seed, f"bs{bs}-{name}")
            row[name] = {k: v for k, v in run.items() if k != "series"}
            print(f"  block size {bs} {name}: {1e3 * run['mean_norm_latency_s']:.2f} ms/token", flush=True)
        return row
    finally:
        free_llm(llm)


def table(res: dict[str, Any]) -> str:
    """The summary printed last: the sustained rate per policy and workload, sharing savings, block sizes."""
    lines = [
        "",
        "policy       workload   sustained req/s   bound ms/token   norm latency ms/token (rate: value); "
        "KV waste at the all-at-once peak",
    ]
    for policy, by_name in res.get("rates", {}).items():
        if "error" in by_name:
            lines.append(f"{policy:<12} {by_name['error']}")
            continue
        for name, sweep in by_name.items():
            if "error" in sweep:
                lines.append(f"{policy:<12} {name:<10} {sweep['error']}")
                continue
            s = sweep["sustained"]
            pts = ", ".join(f"{r['rate']:.3g}: {1e3 * r['mean_norm_latency_s']:.1f}" for r in sweep["runs"])
            rate = "none" if s["max_rate"] is None else f"{s['max_rate']:.3g}"
            lines.append(
                f"{policy:<12} {name:<10} {rate:>15}   {1e3 * (s['bound_s_per_token'] or 0):>14.2f}   {pts}; "
                + waste_text(sweep["saturated"] or max(sweep["runs"], key=lambda r: r["rate"]))
            )
    sharing = res.get("sharing", {})
    if sharing and "error" not in sharing:
        lines += ["", "sharing (Alpaca shape)   width   peak blocks saved   block-steps saved"]
        for key, row in sharing.items():
            if key != "workload":
                kind = key.rsplit("_", 1)[0]
                lines.append(
                    f"{kind:<24} {row['width']:>5}   {row['saved_peak_blocks']:>17.1%}   "
                    f"{row['saved_block_steps']:>17.1%}"
                )
    blocks = {bs: row for bs, row in res.get("block_sizes", {}).items() if "error" not in row}
    if blocks:
        lines += ["", "block size   " + "   ".join(f"{n} ms/token" for n in next(iter(blocks.values())))]
        for bs, row in blocks.items():
            lines.append(
                f"{bs:>10}   "
                + "   ".join(f"{1e3 * r['mean_norm_latency_s']:>{len(n) + 9}.2f}" for n, r in row.items())
            )
    kern = res.get("kernels", {})
    if kern and "error" not in kern:
        from paper_kernels import kernel_table

        lines += ["", kernel_table(kern)]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; `--smoke` scales everything down for the CPU (seconds on the default model)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument(
        "--random-shape",
        choices=("llama-3.1-8b", "llama-13b-mha"),
        help="write a random-weight model of this shape to --model first, unless it is there",
    )
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=["rates", "sharing", "block_sizes"])
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=["paged"])
    ap.add_argument("--workloads", nargs="+", choices=("sharegpt", "alpaca"), default=["sharegpt", "alpaca"])
    ap.add_argument("--sharegpt-file", default=None, help="a ShareGPT JSON file to draw lengths from")
    ap.add_argument("--alpaca-file", default=None, help="an Alpaca JSON file to draw lengths from")
    ap.add_argument("--scale", type=float, default=1.0, help="scale the fitted shapes' means (CPU: small)")
    ap.add_argument("--num-requests", type=int, default=500, help="requests per rate")
    ap.add_argument(
        "--sharegpt-rates",
        type=float,
        nargs="+",
        default=None,
        help="req/s (default: fractions of the saturated throughput)",
    )
    ap.add_argument("--alpaca-rates", type=float, nargs="+", default=None)
    ap.add_argument(
        "--latency-bound", type=float, default=None, help="seconds a token (default: factor x lowest rate's)"
    )
    ap.add_argument("--bound-factor", type=float, default=2.0)
    ap.add_argument(
        "--stop-over-bound",
        action="store_true",
        help="end a sweep at its first rate over the latency bound (rates in ascending order)",
    )
    ap.add_argument(
        "--skip-saturated",
        action="store_true",
        help="leave out the all-at-once run where the rates are given (its peak waste: the highest rate's)",
    )
    ap.add_argument(
        "--same-rates",
        action="store_true",
        help="every policy after the first runs at the first's rates, under its latency bound",
    )
    ap.add_argument(
        "--rates-from",
        default=None,
        help="an earlier result file: every policy runs at its first policy's rates, under its bound",
    )
    ap.add_argument(
        "--widths", type=int, nargs="+", default=[2, 4, 6], help="parallel samples and beam widths"
    )
    ap.add_argument("--sharing-requests", type=int, default=40)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument(
        "--sharegpt-block-rate",
        type=float,
        default=None,
        help="req/s of the block-size runs (default: all at once)",
    )
    ap.add_argument("--alpaca-block-rate", type=float, default=None)
    ap.add_argument("--sharegpt-block-requests", type=int, default=None, help="default: --num-requests")
    ap.add_argument("--alpaca-block-requests", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="KV cache capacity in tokens (default: what memory allows)",
    )
    ap.add_argument("--max-model-len", type=int, default=PAPER_MAX_LEN)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--smoke", action="store_true", help="CPU smoke run: tiny shapes, few requests, fixed rates"
    )
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.smoke:  # what the command line left at its default, scaled down
        smoke = {
            "scale": 0.1,
            "num_requests": 6,
            "max_model_len": 256,
            "sharegpt_rates": [2.0, 8.0],
            "alpaca_rates": [4.0, 16.0],
            "sharing_requests": 3,
            "widths": [2],
            "block_sizes": [8, 16],
            "kv_tokens": 2048,
        }
        for key, value in smoke.items():
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, value)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The command line's run."""
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the sections asked for, print the table last, write the JSON after each part."""
    if args.random_shape:
        make_model(args)
    res: dict[str, Any] = {"benchmark": "paper_eval", **header(args), "rates": {}}
    if "rates" in args.sections:
        refs = reference_sweeps(args.rates_from) if args.rates_from else None
        for policy in args.policies:
            if not policy_supported(policy):
                res["rates"][policy] = {"error": "kv_reservation is not an engine option yet"}
                continue
            print(f"rates, policy {policy}", flush=True)
            section(res["rates"], policy, lambda p=policy, r=refs: run_rates(args, p, r), None)
            if args.json:
                write_json(args.json, res)
            if args.same_rates and refs is None:  # the first policy's sweeps set the later ones' rates
                refs = {
                    n: {**s, "policy": policy}
                    for n, s in res["rates"][policy].items()
                    if isinstance(s, dict) and "runs" in s
                }
    if "sharing" in args.sections:
        print("sharing", flush=True)
        section(res, "sharing", lambda: run_sharing_section(args), args.json)
    if "block_sizes" in args.sections:
        print("block sizes", flush=True)
        run_block_sizes(args, res)
    if "kernels" in args.sections:
        from paper_kernels import run_kernels

        section(res, "kernels", lambda: run_kernels(args.model, args.block_sizes, args.seed), args.json)
    print(table(res))
    return res


def reference_sweeps(path: str) -> dict[str, dict[str, Any]]:
    """Each workload's sweep of the first policy in an earlier result file (`--rates-from`): its rates and
    bound are the ones later policies run at."""
    import json

    with open(path) as f:
        rates = json.load(f).get("rates", {})
    for policy, by_name in rates.items():
        sweeps = {n: s for n, s in by_name.items() if isinstance(s, dict) and "runs" in s}
        if sweeps:
            return {n: {**s, "policy": policy} for n, s in sweeps.items()}
    raise SystemExit(f"--rates-from {path}: no policy's rate sweep in it")


def make_model(args: argparse.Namespace) -> None:
    """Write the random-weight model `--random-shape` names to `--model`, unless a model is there already."""
    from pathlib import Path

    from tinypaged.weights.random_model import make_random_model

    if not args.model:
        raise SystemExit("--random-shape needs --model DIR to write to")
    if not (Path(args.model) / "config.json").exists():
        overrides = LLAMA_13B_MHA if args.random_shape == "llama-13b-mha" else None
        make_random_model("llama-3.1-8b", args.model, seed=args.seed, overrides=overrides)


if __name__ == "__main__":
    main()
