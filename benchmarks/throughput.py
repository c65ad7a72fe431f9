"""Offline throughput, as vLLM's benchmark_throughput: workload W1 (BENCHMARKS.md, "Targets") through the
engine's own loop, against HF transformers' static-batch `generate()` on the same random-weight model in the
same run, and against the workload's roofline.

W1: 256 requests, prompt lengths uniform in [64, 1024], output lengths uniform in [32, 512] (EOS ignored),
uniformly random token ids, seed 1, all submitted at once.

    tinypaged weights random --config llama-3.1-8b --out /tmp/llama-3.1-8b
    python benchmarks/throughput.py --model /tmp/llama-3.1-8b --hf-requests 64 --latency --check \\
        --out benchmarks/results/throughput-h200.json

Roofline (as BENCHMARKS.md defines it): every decode step of an ideal schedule (all requests prefilled, then
decoded together; step k serves the requests with more than k output tokens) reads the weights once and the
K/V of every live context (in a windowed layer, its last window only) at the copy bandwidth, 4.28 TB/s; the
prefills run at the matmul rate, 680 TFLOP/s.
A stricter variant charges each decode step max(bytes, FLOPs) and is printed beside it.

Per-step figures (mixed and decode steps: wall, device time, host time, batch; KV slots at peak) come from the
StepStats each `LLMEngine.step()` returns.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import (
    COPY_TBPS,
    MATMUL_TFLOPS,
    Work,
    add_w1_args,
    device_name,
    fp32_greedy_check,
    free_llm,
    generate_with_stats,
    greedy,
    hf_checks,
    kv_bytes_per_token,
    layer_params,
    load_hf,
    make_workload,
    prefill_flops,
    profile_steps,
    run_checks,
    run_latency,
    step_weight_bytes,
    summarize_steps,
    sync_device,
    w1_engine_args,
)
from common import (
    section as run_section,
)

from tinypaged import LLM
from tinypaged.config import ModelConfig


def ideal_decode_steps(work: Work, windows: tuple[int | None, ...] = ()) -> Iterator[tuple[int, float]]:
    """The roofline's schedule after its prefill: every request decodes in step k (output token k; the first
    comes from the prefill) while it has k tokens or more to produce. Yields (sequences, their total context).
    With the model's layer windows, a context counts only the keys each layer keeps, min(context, window) in a
    windowed layer, averaged over the layers (the bytes and attention FLOPs a step spends on them)."""
    p = np.array([len(w[0]) for w in work], dtype=np.float64)
    o = np.array([w[1] for w in work], dtype=np.float64)
    for k in range(2, int(o.max()) + 1):
        live = o >= k
        ctx = p[live] + k - 1
        kept = [np.minimum(ctx, w).sum() if w else ctx.sum() for w in windows] or [ctx.sum()]
        yield int(live.sum()), float(np.mean(kept))


def roofline(
    cfg: ModelConfig,
    work: Work,
    copy_tbps: float = COPY_TBPS,
    matmul_tflops: float = MATMUL_TFLOPS,
    watts: tuple[float, float, float, float] | None = None,
) -> dict[str, float]:
    """Seconds the workload needs at the copy bandwidth (decode) and the matmul rate (prefill): DESIGN.md's
    measured constants unless a board's own are given.

    With `watts` = (idle, reading at the bandwidth, matmuls at the rate, the board's power limit), also the
    power-capped estimate (benchmarks/energy.py): a decode step's bytes and FLOPs may overlap only as far as the
    power they draw above idle fits under the limit, each costing the energy it costs alone."""
    bw, rate = copy_tbps * 1e12, matmul_tflops * 1e12
    weights, kvb = step_weight_bytes(cfg), kv_bytes_per_token(cfg)
    flops_token = 2 * (
        layer_params(cfg) - 2 * cfg.num_layers * cfg.hidden_size + cfg.vocab_size * cfg.hidden_size
    )
    attn_flops_ctx = 4 * cfg.head_dim * cfg.num_heads * cfg.num_layers
    decode_bytes_s = decode_strict_s = decode_per_op_s = decode_capped_s = 0.0
    idle, reading, computing, limit = watts or (0.0, 0.0, 0.0, 1.0)
    steps = 0
    for n, ctx in ideal_decode_steps(work, cfg.layer_windows):
        t_bytes = (weights + ctx * kvb) / bw
        t_flops = (n * flops_token + ctx * attn_flops_ctx) / rate
        decode_bytes_s += t_bytes
        decode_strict_s += max(t_bytes, t_flops)
        if watts:
            energy = t_bytes * (reading - idle) + t_flops * (computing - idle)  # J above idle
            decode_capped_s += max(t_bytes, t_flops, energy / (limit - idle))
        # Matmuls and attention run one after the other: each at its own floor.
        decode_per_op_s += max(weights / bw, n * flops_token / rate) + max(
            ctx * kvb / bw, ctx * attn_flops_ctx / rate
        )
        steps += 1
    prefill_s = sum(prefill_flops(cfg, len(w[0])) for w in work) / rate
    return {
        "decode_steps": steps,
        "decode_bytes_s": decode_bytes_s,
        "decode_strict_s": decode_strict_s,
        "prefill_s": prefill_s,
        "total_s": decode_bytes_s + prefill_s,
        "total_strict_s": decode_strict_s + prefill_s,
        "decode_per_op_s": decode_per_op_s,
        "total_per_op_s": decode_per_op_s + prefill_s,
    } | ({"decode_capped_s": decode_capped_s, "total_capped_s": decode_capped_s + prefill_s} if watts else {})


def run_ours(llm: LLM, work: Work, async_scheduling: bool = True) -> dict[str, Any]:
    """W1 through the engine's loop, timed end to end (all requests submitted at once), with its step totals."""
    engine = llm.engine
    before, engine.async_scheduling = engine.async_scheduling, async_scheduling
    try:
        return _run_ours(llm, work) | {"async_scheduling": async_scheduling}
    finally:
        engine.async_scheduling = before


def _run_ours(llm: LLM, work: Work) -> dict[str, Any]:
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [greedy(o) for _, o in work]
    # Warm-up on a few short requests: compiles the eager kernels' shapes outside the timed run.
    llm.generate(prompts[:4], greedy(4))
    sync_device()
    t0 = time.perf_counter()
    outs, stats = generate_with_stats(llm, prompts, params)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(o for _, o in work), "every request must produce exactly its output length"
    n_in = sum(len(p) for p, _ in work)
    return {
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "prompt_tokens": n_in,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "steps": summarize_steps(llm, stats),
    }


def profile_ours(llm: LLM, work: Work, windows: int = 20) -> dict[str, Any]:
    """torch.profiler over two windows of W1's steps, a mixed one (from step 4) and a decode-only one (after
    50 decode-only steps): GPU kernel time by kernel and by op class, against the window's wall time (the
    rest is host time, GPU idle). The prefix cache is emptied first: it holds the measured run's prompts, whose
    hits would leave the "mixed" window without prefill."""
    engine = llm.engine
    llm.reset_prefix_cache()
    for i, (p, o) in enumerate(work):
        engine.add_request(f"prof-{i}", {"prompt_token_ids": p}, greedy(o))
    result: dict[str, Any] = {}
    step = decode_seen = 0
    while engine.has_unfinished_requests() and len(result) < 2:
        if step == 4 and "mixed" not in result:
            result["mixed"] = profile_steps(llm, windows)
            step += windows
        elif decode_seen == 50 and "decode" not in result:
            result["decode"] = profile_steps(llm, windows)
            step += windows
        else:
            stats = engine.step().stats
            step += 1
            decode_seen += stats.num_seqs > 0 and stats.num_prefill_tokens == 0
    engine.abort_all()
    return result


def run_hf_static(model: Any, work: Work, batch: int) -> dict[str, Any]:
    """HF static-batch generate(): left-padded batches of `batch`, each run to its longest output; only the
    requested output tokens count."""
    device = model.device
    elapsed = useful = generated = 0
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(chunk):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        max_new = max(o for _, o in chunk)
        ids, mask = ids.to(device), mask.to(device)
        sync_device()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False)
        sync_device()
        elapsed += time.perf_counter() - t0
        assert out.shape[1] == width + max_new
        useful += sum(o for _, o in chunk)
        generated += len(chunk) * max_new
    n_in = sum(len(p) for p, _ in work)
    return {
        "requests": len(work),
        "batch": batch,
        "elapsed_s": elapsed,
        "output_tokens": useful,
        "output_tokens_per_s": useful / elapsed,
        "total_tokens_per_s": (n_in + useful) / elapsed,
        "generated_tokens_incl_padding_per_s": generated / elapsed,
    }


def run_hf_generate_batch(model: Any, work: Work) -> dict[str, Any]:
    """HF's continuous-batching generate_batch() (one max_new_tokens for all: the longest; only the requested
    output tokens count)."""
    from transformers import GenerationConfig

    max_new = max(o for _, o in work)
    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    sync_device()
    t0 = time.perf_counter()
    model.generate_batch(inputs=[p for p, _ in work], generation_config=cfg)
    sync_device()
    elapsed = time.perf_counter() - t0
    useful = sum(o for _, o in work)
    return {
        "requests": len(work),
        "elapsed_s": elapsed,
        "output_tokens_per_s": useful / elapsed,
        "max_new_tokens": max_new,
    }


def print_table(res: dict[str, Any]) -> None:
    """The figures that matter, last in the output."""
    ours, roof = res["ours"], res["roofline"]
    lines = [
        "",
        f"W1 on {res['device']} ({res['requests']} requests, {ours['output_tokens']} output tokens, "
        f"{ours['prompt_tokens']} prompt tokens)",
        "| system | output tok/s | total tok/s | elapsed s |",
        "|---|---|---|---|",
        f"| tinypaged | {ours['output_tokens_per_s']:.0f} | {ours['total_tokens_per_s']:.0f} | "
        f"{ours['elapsed_s']:.2f} |",
    ]
    sync = res.get("ours_sync")
    if isinstance(sync, dict) and "elapsed_s" in sync:
        lines.append(
            f"| tinypaged, async scheduling off | {sync['output_tokens_per_s']:.0f} | "
            f"{sync['total_tokens_per_s']:.0f} | {sync['elapsed_s']:.2f} |"
        )
    for key, name in (
        ("hf_static", "HF generate() static batch"),
        ("hf_generate_batch", "HF generate_batch()"),
    ):
        hf = res.get(key)
        if isinstance(hf, dict) and "output_tokens_per_s" in hf:
            lines.append(
                f"| {name} ({hf['requests']} req) | {hf['output_tokens_per_s']:.0f} | "
                f"{hf.get('total_tokens_per_s', float('nan')):.0f} | {hf['elapsed_s']:.2f} |"
            )
            lines.append(
                f"|   speed-up of tinypaged | "
                f"{ours['output_tokens_per_s'] / hf['output_tokens_per_s']:.1f}x | | |"
            )
    lines.append(
        f"| roofline (decode bytes + prefill FLOPs) | {ours['output_tokens'] / roof['total_s']:.0f} | | "
        f"{roof['total_s']:.2f} |"
    )
    lines.append(
        f"| roofline, strict (max(bytes, FLOPs) per decode step) | "
        f"{ours['output_tokens'] / roof['total_strict_s']:.0f} | | {roof['total_strict_s']:.2f} |"
    )
    lines.append(
        f"| floor per op (matmuls then attention, each at its own limit) | "
        f"{ours['output_tokens'] / roof['total_per_op_s']:.0f} | | {roof['total_per_op_s']:.2f} |"
    )
    lines.append(
        f"fraction of roofline: {roof['total_s'] / ours['elapsed_s']:.1%} "
        f"(strict: {roof['total_strict_s'] / ours['elapsed_s']:.1%}); roofline parts: decode "
        f"{roof['decode_bytes_s']:.2f} s (strict {roof['decode_strict_s']:.2f}), "
        f"prefill {roof['prefill_s']:.2f} s"
    )
    st = ours["steps"]
    lines.append(
        f"KV slot utilisation at peak: {st['kv_peak']['slot_utilisation']:.2%} "
        f"({st['kv_peak']['tokens']} tokens in {st['kv_peak']['blocks_used']} blocks)"
    )
    for ph in ("mixed", "decode"):
        s = st[ph]
        lines.append(
            f"{ph} steps (async): {s['steps']}, wall {s['wall_s']:.2f} s, runner GPU {s['runner_gpu_s']:.2f} s "
            f"({s['gpu_busy_fraction']:.0%} busy), host {s['host_ms_per_step']:.2f} ms/step, "
            f"mean batch {s['mean_batch_seqs']:.0f} seqs / {s['mean_batch_tokens']:.0f} tokens"
        )
    if "latency" in res:
        lat = res["latency"]
        lines.append(
            f"batch-1 decode (roofline {lat['roofline_decode_tokens_per_s']:.0f} tok/s): "
            + ", ".join(
                f"{m} {lat[m]['decode_tokens_per_s']:.1f} tok/s "
                f"({lat[m]['fraction_of_roofline']:.0%}; per step "
                f"GPU {lat[m]['runner_gpu_ms_per_step']:.2f} ms, host {lat[m]['host_ms_per_step']:.2f} ms)"
                for m in ("graphs", "graphs_sync", "eager")
                if m in lat
            )
            + f"; TTFT {lat['ttft']['prompt_len']} tokens: {lat['ttft']['median_ms']:.1f} ms "
            f"(compute floor {lat['ttft']['compute_floor_ms']:.1f} ms)"
        )
    if "check" in res and "error" in res["check"]:
        lines.append(f"numerics: the check failed: {res['check']['error']}")
    elif "check" in res:
        c = res["check"]
        lines.append(
            f"numerics: greedy Triton == torch-ref: {c['greedy_equal']}, graphs == eager: "
            f"{c['greedy_graphs_equal_eager']} (common prefixes Triton/ref "
            f"{c['greedy_common_prefix']} of {c['max_tokens']}); prompt logits max-abs "
            f"{c['logits_max_abs_triton_vs_torch_ref']:.4f} (|logit| max {c['logits_max_abs_ref']:.2f})"
        )
    f = res.get("check_fp32")
    if isinstance(f, dict) and "graphs_equal_ref" in f:
        lines.append(
            f"numerics fp32: greedy Triton+graphs == torch-ref: {f['graphs_equal_ref']}, eager == ref: "
            f"{f['eager_equal_ref']} ({len(f['prompt_lens'])} prompts x {f['max_tokens']} tokens)"
        )
    h = res.get("check_hf")
    if isinstance(h, dict) and "hf_bf16" in h:
        lines.append(
            f"prompt logits vs HF float32 (|logit| max {h['oracle_logits_max_abs']:.2f}): "
            + ", ".join(
                f"{k} max-abs {h[k]['max_abs']:.4f} rel {h[k]['rel_l2']:.2e}"
                for k in ("ours_triton_bf16", "ours_torch_ref_bf16", "hf_bf16", "ours_vs_hf_bf16")
            )
            + f"; greedy common prefixes HF bf16 vs ours {h['greedy_common_prefix_hf_bf16_vs_ours']}"
        )
    for name, w in res.get("profile", {}).items():
        if isinstance(w, dict) and "by_class_s" in w:
            cls = ", ".join(f"{k} {1e3 * v / w['steps']:.2f}" for k, v in w["by_class_s"].items())
            lines.append(
                f"profile {name}: {1e3 * w['wall_s'] / w['steps']:.2f} ms/step wall, "
                f"{1e3 * w['gpu_kernel_s'] / w['steps']:.2f} ms/step kernels "
                f"({w['gpu_idle_fraction']:.0%} idle); "
                f"ms/step by class: {cls}"
            )
            if "gaps_ms_per_step" in w:
                gaps = ", ".join(f"{k} {v:.3f}" for k, v in w["gaps_ms_per_step"].items())
                lines.append(
                    f"profile {name}: device span {w['span_ms_per_step']:.2f} ms/step, busy "
                    f"{w['busy_ms_per_step']:.2f}; gaps ms/step {gaps} ({w['short_gaps_per_step']:.0f} short)"
                )
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory (e.g. from `tinypaged weights random`)")
    add_w1_args(ap)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument(
        "--hf-requests", type=int, default=64, help="run HF static generate() on the first N (0: skip)"
    )
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument(
        "--hf-generate-batch-requests", type=int, default=0, help="HF generate_batch() on the first N"
    )
    ap.add_argument("--latency", action="store_true", help="also run benchmarks/latency.py's measurements")
    ap.add_argument("--check", action="store_true", help="also run the GPU numerics checks")
    ap.add_argument("--profile", action="store_true", help="profile a mixed and a decode window of W1")
    ap.add_argument(
        "--compare-sync",
        action="store_true",
        help="also run W1 with async scheduling off, on the same engine",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    def engine(enforce_eager: bool) -> LLM:
        return LLM(model=args.model, enforce_eager=enforce_eager, **w1_engine_args(args))

    t0 = time.perf_counter()
    try:
        llm = engine(args.enforce_eager)
    except Exception:  # e.g. a graph capture that fails: still measure the eager engine, and say so
        if args.enforce_eager:
            raise
        traceback.print_exc()
        args.enforce_eager = True
        torch.cuda.empty_cache()
        llm = engine(True)
    cfg = llm.config.model_config
    res: dict[str, Any] = {
        "device": device_name(),
        "torch": torch.__version__,
        "model": args.model,
        "date": time.strftime("%Y-%m-%d"),
        "requests": args.num_requests,
        "seed": args.seed,
        "prompt_range": args.prompt_range,
        "output_range": args.output_range,
        "engine": {
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "enforce_eager": args.enforce_eager,
            "num_gpu_blocks": llm.engine.runner.num_gpu_blocks,
            "init_s": time.perf_counter() - t0,
            "runner": asdict(llm.engine.runner.stats),
        },
    }
    work = make_workload(args.num_requests, cfg.vocab_size, args.seed, args.prompt_range, args.output_range)
    res["roofline"] = roofline(cfg, work)

    def section(name: str, fn: Any) -> Any:
        return run_section(res, name, fn, args.out)

    state: dict[str, Any] = {}
    if args.check:
        section("check", lambda: _split(run_checks(llm), state))
    section("ours", lambda: run_ours(llm, work))
    if args.compare_sync:
        section("ours_sync", lambda: run_ours(llm, work, async_scheduling=False))
    print(json.dumps({k: res[k] for k in ("engine", "roofline", "ours")}, indent=1, default=str), flush=True)
    if args.latency:
        section("latency", lambda: run_latency(llm))
    if args.profile:
        section("profile", lambda: profile_ours(llm, work))
    if args.hf_requests or args.hf_generate_batch_requests or state:
        free_llm(llm)
        if state:
            section("check_fp32", lambda: fp32_greedy_check(args.model))
        if state:
            section("check_hf", lambda: hf_checks(args.model, state))
        t1 = time.perf_counter()
        model = load_hf(args.model)
        res["hf_load_s"] = time.perf_counter() - t1
        if args.hf_requests:
            section("hf_static", lambda: run_hf_static(model, work[: args.hf_requests], args.hf_batch))
        if args.hf_generate_batch_requests:
            section(
                "hf_generate_batch",
                lambda: run_hf_generate_batch(model, work[: args.hf_generate_batch_requests]),
            )
    try:
        print_table(res)
    except Exception:
        traceback.print_exc()


def _split(pair: tuple[dict[str, Any], dict[str, Any]], state: dict[str, Any]) -> dict[str, Any]:
    report, st = pair
    state.update(st)
    return report


if __name__ == "__main__":
    main()
