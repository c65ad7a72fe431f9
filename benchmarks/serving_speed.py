"""Serving speed as users see it (issue "Serving speed as users see it"), all in one call on the GPU: offline W1
greedy and sampled, the sampler alone, batch-1 decode, then the same W1 requests over HTTP against a real
`tinypaged serve` process, as a burst of concurrent streams and as a Poisson arrival process; a table
against the targets is printed last.

    tinypaged weights random --config llama-3.1-8b --out /tmp/llama-3.1-8b
    python3 benchmarks/serving_speed.py --model /tmp/llama-3.1-8b --out benchmarks/results/serving-speed-h200.json

W1's shape (256 requests, prompts 64-1024, outputs 32-512 random token ids, EOS ignored) with seed 2. The
sampled runs give each request its own seed. Offline and servers use --max-model-len 2048 and the defaults
otherwise, but for the token budget a step: the offline runs at `LLM`'s default (8192) and at each other of
--budgets (greedy), the servers at --server-budgets (`tinypaged serve`'s default, 512). HTTP's own cost is the
burst against offline at the server's budget; the budget's cost is offline at 512 against 8192.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import torch
from common import Work, device_name, free_llm, generate_with_stats, make_workload, run_latency, write_json
from common import section as run_section
from throughput import roofline

from tinypaged import LLM, SamplingParams, ops
from tinypaged.config import SERVE_DEFAULTS, EngineConfig
from tinypaged.server.local import LocalServer

SAMPLED = {
    "greedy": {"temperature": 0.0},
    "t0.8_p0.95": {"temperature": 0.8, "top_p": 0.95},
    "k50_minp0.05": {"temperature": 1.0, "top_k": 50, "min_p": 0.05},
}


def offline(llm: LLM, work: Work, name: str, cold: bool = True, mixed_graphs: bool = True) -> dict[str, Any]:
    """W1 through the engine's own loop with the `name` sampling settings (a seed per request). `cold`: the
    prefix cache emptied first (else it holds what earlier runs left, which this run's blocks evict).
    `mixed_graphs` off: steps with prefill chunks run eagerly (decode steps still replay their graphs)."""
    kw = SAMPLED[name]
    runner = llm.engine.runner
    runner.use_mixed_graphs = mixed_graphs
    params = [
        SamplingParams(max_tokens=o, ignore_eos=True, seed=None if name == "greedy" else i, **kw)
        for i, (_, o) in enumerate(work)
    ]
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    # Warm-up on the first prompts reversed: the same shapes, no prefix the measured run could hit.
    llm.generate([{"prompt_token_ids": p[::-1]} for p, _ in work[:4]], params[:4])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs, stats = generate_with_stats(llm, prompts, params, time_device=False, cold=cold)
    elapsed = time.perf_counter() - t0
    runner.use_mixed_graphs = True
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(o for _, o in work)
    return {
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "output_tokens_per_s": n_out / elapsed,
        "steps": len(stats),
        "step_s_total": sum(s.total_s for s in stats),  # the engine's host time in steps
        "host_sample_s": sum(s.sample_s for s in stats),  # queuing the sampling pass
        "host_wait_s": sum(s.wait_s for s in stats),  # waiting for sampled tokens
        "mixed_steps": sum(1 for s in stats if s.num_prefill_tokens),
        "mixed_steps_in_graphs": sum(1 for s in stats if s.num_prefill_tokens and s.graph_num_tokens),
        "steps_over_ms": {str(ms): sum(1 for s in stats if s.total_s > ms / 1e3) for ms in (25, 50, 100)},
        "slowest_steps": [slow_step(s) for s in sorted(stats, key=lambda s: -s.total_s)[:8]],
    }


def slow_step(s: Any) -> dict[str, Any]:
    """One step's shape and its host phases (ms), to tell what a slow step waited on."""
    return {
        "step": s.step,
        "prefill_tokens": s.num_prefill_tokens,
        "decodes": s.num_decode_tokens,
        "graph": s.graph_batch_size or s.graph_num_tokens,
        "applied": s.applied_steps,
        **{
            p: round(1e3 * getattr(s, f"{p}_s"), 2)
            for p in ("schedule", "execute", "sample", "update", "wait", "total")
        },
    }


def sampler_alone(vocab: int, rows: int = 256, reps: int = 50) -> dict[str, Any]:
    """ms per call of the sampling op on `[rows, vocab]` bf16 logits, beside argmax, per setting."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    keys = torch.randint(0, 1 << 62, (rows,), device="cuda", generator=gen)
    out: dict[str, Any] = {}

    def timed(fn: Any) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    out["argmax_ms"] = timed(lambda: logits.argmax(dim=-1))
    for name, kw in SAMPLED.items():
        if name == "greedy":
            continue

        def full(key: str, default: float, dtype: torch.dtype = torch.float32, kw: dict = kw) -> torch.Tensor:
            return torch.full((rows,), kw.get(key, default), dtype=dtype, device="cuda")

        params = ops.SampleParams(
            full("temperature", 1.0),
            full("top_k", 0, torch.int64),
            full("top_p", 1.0),
            full("min_p", 0.0),
            keys,
        )
        out[f"{name}_ms"] = timed(lambda params=params: ops.sample(logits, params))
        # The kernel against the torch reference at this shape, on the GPU: the same draws from the same keys.
        with ops.torch_reference_ops():
            want = ops.sample(logits, params)
        out[f"{name}_same_as_reference"] = float((ops.sample(logits, params) == want).float().mean())
    return out


# ---- HTTP ----------------------------------------------------------------------------------------------------


async def stream_one(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, delay: float
) -> dict[str, Any]:
    """One streamed completion after `delay` s: TTFT, the gaps between token chunks, tokens, errors."""
    await asyncio.sleep(delay)
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = last = time.perf_counter()
    res: dict[str, Any] = {"ttft": None, "itl": [], "tokens": 0, "chunks": 0, "error": None}
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            res["error"] = f"HTTP {resp.status}"
            return res
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                res["error"] = chunk["error"]["message"]
                break
            if chunk.get("usage"):
                res["tokens"] = chunk["usage"]["completion_tokens"]
            if not chunk["choices"]:
                continue
            now = time.perf_counter()
            res["chunks"] += 1
            if res["ttft"] is None:
                res["ttft"] = now - start
            else:
                res["itl"].append(now - last)
            last = now
    res["e2e"] = time.perf_counter() - start
    return res


def pct(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values) * 1e3
    return {
        "p50_ms": float(np.percentile(arr, 50)),
        "p99_ms": float(np.percentile(arr, 99)),
        "mean_ms": float(arr.mean()),
    }


async def http_run(url: str, work: Work, rate: float | None, seed: int = 0) -> dict[str, Any]:
    """The requests all at once (rate None) or as a Poisson process at `rate` requests/s."""
    rng = np.random.default_rng(seed)
    delays = np.zeros(len(work)) if rate is None else np.cumsum(rng.exponential(1 / rate, len(work)))
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    steps, step_s = "tinypaged:engine_steps_total", "tinypaged:engine_step_seconds_sum"

    def le(ms: int) -> str:  # the step-time histogram's bucket of steps up to `ms`
        return f"tinypaged:engine_step_seconds_bucket{{le={ms / 1e3:g}}}"

    before = await asyncio.to_thread(scrape, url)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(stream_one(session, url, p, o, float(d)) for (p, o), d in zip(work, delays, strict=True))
        )
        elapsed = time.perf_counter() - t0
    after = await asyncio.to_thread(scrape, url)
    n_steps = after[steps] - before[steps]
    # Where HTTP's time goes: the engine thread's step time against the run's wall time (the rest is the
    # engine waiting for the event loop between steps, or idle), and the steps' mean against offline's.
    engine = {
        "steps": n_steps,
        "step_s_total": after[step_s] - before[step_s],
        "busy_fraction": (after[step_s] - before[step_s]) / elapsed,
        "mean_step_ms": 1e3 * (after[step_s] - before[step_s]) / max(1.0, n_steps),
        # Steps whose host time exceeded 25, 50 and 100 ms (the step-time histogram's buckets).
        "steps_over_ms": {str(ms): n_steps - (after[le(ms)] - before[le(ms)]) for ms in (25, 50, 100)},
    }
    ok = [r for r in results if r["error"] is None]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "rate": rate,
        "completed": len(ok),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "ttft": pct([r["ttft"] for r in ok]),
        "itl": pct([x for r in ok for x in r["itl"]]),
        # Tokens that reached their client merged into a chunk with the next (the stream lagged the engine).
        "merged_token_fraction": 1 - sum(r["chunks"] for r in ok) / max(1, tokens),
        "engine": engine,
    }


def serve_and_measure(
    model: str,
    works: tuple[Work, Work],
    rate: float,
    max_model_len: int,
    budget: int,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Start `tinypaged serve` with this token budget per step (and the `extra` flags), run the burst (of
    `works[0]`) and the Poisson run (of `works[1]`: other prompts, so that the prefix cache holds none of them);
    stop it."""
    flags = ["--model", model, "--max-model-len", str(max_model_len), "--max-num-batched-tokens", str(budget)]
    flags += extra
    t0 = time.perf_counter()
    with LocalServer(flags, start_timeout=600) as server:
        out: dict[str, Any] = {"server_start_s": time.perf_counter() - t0}
        asyncio.run(http_run(server.url, [(p[::-1], o) for p, o in works[0][:8]], None))  # warm-up
        out["burst"] = asyncio.run(http_run(server.url, works[0], None))
        out["poisson"] = asyncio.run(http_run(server.url, works[1], rate))
        return out


# Synthetic chats whose turns resend the whole history: what prefix caching is for. The random models'
# tokenizer encodes text byte by byte (40-80 words are ~250-500 tokens, an answer's token ~6), so a 6-turn
# history reaches ~4,000 tokens: the servers get --max-model-len 8192 for these.
MULTI_TURN = [
    "--dataset", "multi-turn", "--num-prompts", "48", "--turns", "4-6", "--prompt-len", "40-80",
    "--output-len", "16-32", "--request-rate", "4", "--seed", "5",
]  # fmt: skip
MULTI_TURN_MAX_MODEL_LEN = 8192


def multi_turn_run(url: str) -> dict[str, Any]:
    """loadtest/bench_serving.py's multi-turn workload against `url`; its summary and the server's prefix-cache
    hit rate over the run."""
    bench = Path(__file__).resolve().parents[1] / "loadtest" / "bench_serving.py"
    hits0, queries0 = prefix_counters(url)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "multi_turn.json"
        cmd = [sys.executable, str(bench), "--url", url, *MULTI_TURN, "--out", str(out)]
        # Exit status 1 means some requests failed: they are counted in the summary, which is what we keep.
        subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
        summary = json.loads(out.read_text())["runs"][0]["summary"]
    hits1, queries1 = prefix_counters(url)
    keys = ("completed", "failed", "errors", "duration_s", "total_input_tokens", "output_throughput")
    res = {k: summary[k] for k in keys} | {"ttft_ms": summary["ttft_ms"], "itl_ms": summary["itl_ms"]}
    res["prefix_hit_rate"] = (hits1 - hits0) / max(1.0, queries1 - queries0)
    return res


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics samples by name (labels dropped; one model, so one sample per name)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            base, _, labels = name.partition("{")
            le = labels.partition('le="')[2].partition('"')[0]
            values[f"{base}{{le={le}}}" if le else base] = float(value)
    return values


def prefix_counters(url: str) -> tuple[float, float]:
    """The server's prefix-cache hit and query counters (blocks)."""
    m = scrape(url)
    return m.get("tinypaged:prefix_cache_hits_total", 0.0), m.get("tinypaged:prefix_cache_queries_total", 0.0)


def multi_turn_on_and_off(model: str, budget: int) -> dict[str, Any]:
    """The multi-turn chats against a server with prefix caching on (the default), then one with it off."""
    flags = ["--model", model, "--max-model-len", str(MULTI_TURN_MAX_MODEL_LEN)]
    out = {}
    for name, extra in (("on", ["--enable-prefix-caching"]), ("off", ["--no-enable-prefix-caching"])):
        with LocalServer(
            [*flags, "--max-num-batched-tokens", str(budget), *extra], start_timeout=600
        ) as server:
            out[name] = multi_turn_run(server.url)
    return out


def prefix_caching_cost(model: str, works: list[Work], max_model_len: int, budget: int) -> dict[str, Any]:
    """W1 greedy with prefix caching on and off on `works[1:]`, workloads with no shared prefix. The engine
    with it on first runs `works[0]`, so that its cache is full of blocks the measured runs must evict."""
    kw = {"max_model_len": max_model_len, "max_num_batched_tokens": budget}
    llm_on = LLM(model=model, enable_prefix_caching=True, **kw)
    offline(llm_on, works[0], "greedy")
    on = [offline(llm_on, w, "greedy", cold=False) for w in works[1:]]
    free_llm(llm_on)
    llm_off = LLM(model=model, enable_prefix_caching=False, **kw)
    off = [offline(llm_off, w, "greedy") for w in works[1:]]
    free_llm(llm_off)
    ratios = [a["output_tokens_per_s"] / b["output_tokens_per_s"] for a, b in zip(on, off, strict=True)]
    return {
        "on_tok_s": [r["output_tokens_per_s"] for r in on],
        "off_tok_s": [r["output_tokens_per_s"] for r in off],
        "on_over_off": ratios,
        "mean_on_over_off": sum(ratios) / len(ratios),
    }


# ---- table ---------------------------------------------------------------------------------------------------


def table(res: dict[str, Any]) -> str:
    off, srv = res.get("offline", {}), res.get("server", {})
    greedy = off.get("greedy", {}).get("output_tokens_per_s")
    rows = []

    def row(measure: str, value: str, target: str, ok: bool | None) -> None:
        rows.append(f"| {measure} | {value} | {target} | {'-' if ok is None else 'yes' if ok else 'NO'} |")

    if greedy:
        frac = greedy * res["roofline"]["total_strict_s"] / off["greedy"]["output_tokens"]
        row("W1 offline greedy", f"{greedy:.0f} tok/s = {frac:.0%} of strict roofline", ">= 80%", frac >= 0.8)
        for name in ("t0.8_p0.95", "k50_minp0.05"):
            v = off.get(name, {}).get("output_tokens_per_s")
            if v:
                row(
                    f"W1 offline {name}, seed per request",
                    f"{v:.0f} tok/s = {v / greedy:.1%} of greedy",
                    ">= 95% of greedy",
                    v / greedy >= 0.95,
                )
    burst, poisson = srv.get("burst"), srv.get("poisson")
    if burst and greedy:
        # HTTP's own cost: against W1 offline at the server's budget; the budget's cost beside it.
        v, budget = burst["output_tokens_per_s"], srv.get("budget")
        same = (res["by_budget"].get(budget, {}).get("offline_greedy") or {}).get(
            "output_tokens_per_s"
        ) or greedy
        row(
            f"W1 as 256 concurrent streams ({budget} tokens a step)",
            f"{v:.0f} tok/s = {v / same:.1%} of offline at {budget} ({v / greedy:.1%} of offline at "
            f"{next(iter(res['by_budget']))})",
            ">= 95% of offline",
            v / same >= 0.95,
        )
        row(
            "  its ITL p99",
            f"{burst['itl']['p99_ms']:.1f} ms (p50 {burst['itl']['p50_ms']:.1f})",
            "<= 40 ms",
            burst["itl"]["p99_ms"] <= 40,
        )
        row(
            "  its TTFT p50 / p99",
            f"{burst['ttft']['p50_ms']:.0f} / {burst['ttft']['p99_ms']:.0f} ms",
            "-",
            None,
        )
        inproc = (res.get("server_in_process") or {}).get("burst")
        if inproc:
            w = inproc["output_tokens_per_s"]
            row(
                "  the same, the engine in the server's process (--no-engine-process)",
                f"{w:.0f} tok/s = {w / same:.1%} of offline; ITL p99 {inproc['itl']['p99_ms']:.1f} ms",
                "-",
                None,
            )
        eng, g = burst.get("engine"), res["by_budget"].get(budget, {}).get("offline_greedy") or off["greedy"]
        if eng and "step_s_total" in g:
            row(
                "  engine steps: busy share of the run; steps and mean step, HTTP vs offline",
                f"{eng['busy_fraction']:.1%}; {eng['steps']:.0f} vs {g['steps']}, {eng['mean_step_ms']:.2f} vs "
                f"{1e3 * g['step_s_total'] / g['steps']:.2f} ms",
                "-",
                None,
            )
    if poisson:
        row(
            f"Poisson {poisson['rate']:g} req/s: TTFT p99",
            f"{poisson['ttft']['p99_ms']:.0f} ms (p50 {poisson['ttft']['p50_ms']:.0f})",
            "<= 100 ms",
            poisson["ttft"]["p99_ms"] <= 100,
        )
        row(
            "  its ITL p99",
            f"{poisson['itl']['p99_ms']:.1f} ms (p50 {poisson['itl']['p50_ms']:.1f})",
            "<= 25 ms",
            poisson["itl"]["p99_ms"] <= 25,
        )
    pc = res.get("prefix_caching")
    if isinstance(pc, dict) and "mean_on_over_off" in pc:
        row(
            "W1 greedy, prefix caching on / off (no shared prefixes)",
            " / ".join(f"{r:.1%}" for r in pc["on_over_off"]) + f" (mean {pc['mean_on_over_off']:.1%})",
            ">= 99%",
            pc["mean_on_over_off"] >= 0.99,
        )
    mt = res.get("multi_turn", {})
    mt_on, mt_off = mt.get("on"), mt.get("off")
    if isinstance(mt_on, dict) and isinstance(mt_off, dict) and "ttft_ms" in mt_off:
        a, b = mt_on["ttft_ms"], mt_off["ttft_ms"]
        row(
            "multi-turn chats: TTFT p50 / p99, prefix caching on vs off",
            f"{a['median']:.0f} / {a['p99']:.0f} ms vs {b['median']:.0f} / {b['p99']:.0f} ms "
            f"(hit rate {mt_on['prefix_hit_rate']:.0%})",
            "visibly lower",
            a["median"] < b["median"],
        )
    lat = res.get("latency", {}).get("graphs")
    if lat:
        row(
            "batch-1 decode, 512-token prompt",
            f"{lat['decode_tokens_per_s']:.1f} tok/s = {lat['fraction_of_roofline']:.0%} of roofline",
            ">= 78%",
            lat["fraction_of_roofline"] >= 0.78,
        )
    samp = res.get("sampler_alone")
    if samp:
        parts = ", ".join(f"{k.removesuffix('_ms')} {v:.3f}" for k, v in samp.items() if k.endswith("_ms"))
        row("sampler alone, 256 x vocab bf16 (ms)", parts, "-", None)
        same = min(v for k, v in samp.items() if k.endswith("_same_as_reference"))
        row("kernel draws = torch reference's (same keys)", f"{same:.2%} of rows", ">= 97%", same >= 0.97)
    main_table = "| measure | now | target | met |\n|---|---|---|---|\n" + "\n".join(rows)
    budgets = res.get("by_budget", {})
    if len(budgets) < 2:
        return main_table
    lines = [
        "| tokens per step | W1 offline tok/s (mixed steps eager) | 256 streams tok/s (% offline) | ITL p50 / p99 ms "
        "| steps > 50 ms; tokens merged | Poisson TTFT p50 / p99 ms | Poisson ITL p50 / p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for budget, r in budgets.items():
        off_tps = (r.get("offline_greedy") or {}).get("output_tokens_per_s")
        eager = (r.get("offline_greedy_eager_mixed") or {}).get("output_tokens_per_s")
        b, p = r.get("burst"), r.get("poisson")
        if not off_tps or not b or not p:
            continue
        lines.append(
            f"| {budget} | {off_tps:.0f}{f' ({eager:.0f})' if eager else ''} | {b['output_tokens_per_s']:.0f} "
            f"({b['output_tokens_per_s'] / off_tps:.1%}) | {b['itl']['p50_ms']:.1f} / {b['itl']['p99_ms']:.1f} | "
            f"{b['engine']['steps_over_ms']['50']:.0f} of {b['engine']['steps']:.0f}; "
            f"{b['merged_token_fraction']:.1%} | {p['ttft']['p50_ms']:.0f} / {p['ttft']['p99_ms']:.0f} | "
            f"{p['itl']['p50_ms']:.1f} / {p['itl']['p99_ms']:.1f} |"
        )
    return main_table + "\n\n" + "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--rate", type=float, default=16.0, help="Poisson arrivals, requests/s")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=[EngineConfig.max_num_batched_tokens, 512],
        help="max_num_batched_tokens: the first is the offline runs' (LLM's default), the others are run offline "
        "too, greedy; the servers run at --server-budgets",
    )
    ap.add_argument(
        "--server-budgets",
        type=int,
        nargs="+",
        default=[SERVE_DEFAULTS["max_num_batched_tokens"]],
        help="max_num_batched_tokens of the servers (each also in --budgets); the first is the main table's "
        "(`tinypaged serve`'s default)",
    )
    ap.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["offline", "sampled", "latency", "sampler", "prefix", "server", "multi_turn"],
    )
    ap.add_argument(
        "--eager-mixed",
        action="store_true",
        help="at each budget after the first, W1 offline with steps that hold prefill chunks run eagerly too",
    )
    ap.add_argument(
        "--in-process-server",
        action="store_true",
        help="also serve at the first server budget with the engine in the server's process "
        "(--no-engine-process), beside the engine-core process",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/serving-speed-h200.json"))
    args = ap.parse_args()

    res: dict[str, Any] = {
        "device": device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }

    def section(name: str, fn: Any) -> None:
        run_section(res, name, fn, args.out)
        print(f"{name}: {json.dumps(res[name], default=str)[:600]}", flush=True)

    budgets = args.budgets
    if not set(args.server_budgets) <= set(budgets):
        ap.error(
            "each of --server-budgets must be in --budgets (its offline run is the HTTP run's reference)"
        )
    llm = LLM(model=args.model, max_model_len=args.max_model_len, max_num_batched_tokens=budgets[0])
    cfg = llm.config.model_config
    work = make_workload(args.num_requests, cfg.vocab_size, args.seed)
    res["roofline"] = roofline(cfg, work)
    if "offline" not in args.skip:
        res["offline"] = {}
        for name in SAMPLED if "sampled" not in args.skip else ["greedy"]:
            section("offline_" + name, lambda name=name: offline(llm, work, name))
            res["offline"][name] = res.pop("offline_" + name)
        if args.eager_mixed:
            section("offline_eager_mixed", lambda: offline(llm, work, "greedy", mixed_graphs=False))
            res["offline"]["greedy_eager_mixed"] = res.pop("offline_eager_mixed")
    if "sampler" not in args.skip:
        section("sampler_alone", lambda: sampler_alone(cfg.vocab_size))
    if "latency" not in args.skip:
        section("latency", lambda: run_latency(llm))
    free_llm(llm)
    if "prefix" not in args.skip:
        works = [work] + [make_workload(args.num_requests, cfg.vocab_size, args.seed + k) for k in (1, 2)]
        section(
            "prefix_caching", lambda: prefix_caching_cost(args.model, works, args.max_model_len, budgets[0])
        )
    # The token budget per step: W1 offline (greedy) and over HTTP at each of the other budgets.
    off = res.get("offline", {})
    res["by_budget"] = {
        budgets[0]: {
            "offline_greedy": off.get("greedy"),
            "offline_greedy_eager_mixed": off.get("greedy_eager_mixed"),
        }
    }
    for budget in budgets[1:]:
        llm = LLM(model=args.model, max_model_len=args.max_model_len, max_num_batched_tokens=budget)
        section("offline_budget", lambda llm=llm: offline(llm, work, "greedy"))
        res["by_budget"][budget] = {"offline_greedy": res.pop("offline_budget")}
        if args.eager_mixed:
            section("offline_budget", lambda llm=llm: offline(llm, work, "greedy", mixed_graphs=False))
            res["by_budget"][budget]["offline_greedy_eager_mixed"] = res.pop("offline_budget")
        free_llm(llm)
    if "server" not in args.skip:
        works = (work, make_workload(args.num_requests, cfg.vocab_size, args.seed + 1))
        for budget in args.server_budgets:
            section(
                "server_budget",
                lambda b=budget: serve_and_measure(args.model, works, args.rate, args.max_model_len, b),
            )
            res["by_budget"][budget].update(res.pop("server_budget"))
        res["server"] = res["by_budget"][args.server_budgets[0]] | {"budget": args.server_budgets[0]}
        if args.in_process_server:
            budget = args.server_budgets[0]
            section(
                "server_in_process",
                lambda: serve_and_measure(
                    args.model, works, args.rate, args.max_model_len, budget, ("--no-engine-process",)
                ),
            )
    if "multi_turn" not in args.skip:
        section("multi_turn", lambda: multi_turn_on_and_off(args.model, args.server_budgets[0]))
    res["table"] = table(res)
    write_json(args.out, res)
    if os.environ.get("OUT"):
        write_json(Path(os.environ["OUT"]) / args.out.name, res)
    print("\n" + res["table"])


if __name__ == "__main__":
    main()
