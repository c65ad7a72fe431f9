"""Serving benchmark against a running `tinypaged serve` (or any OpenAI-compatible server), as vLLM's
benchmark_serving measures one: TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99), request and
token throughput, goodput under SLOs, and the server's running / waiting requests and KV cache usage sampled
from `/metrics` during the run; over one request rate or a sweep of them; JSON results and PNG plots.

    .venv/bin/python loadtest/bench_serving.py --url http://127.0.0.1:8000 --num-prompts 200 \\
        --prompt-len 64-1024 --output-len 32-512 --vocab 128000 --request-rate 4 8 16 inf \\
        --goodput ttft:200 tpot:50 --out results.json --plot-dir plots/

Workloads (`--dataset`), both from `--seed`:
- `random`: streamed `/v1/completions` of random token ids (lengths from `--prompt-len`, below `--vocab`),
  EOS ignored, so each request produces exactly its `--output-len` draw;
- `multi-turn`: `--num-prompts` synthetic chats of `--turns` turns on `/v1/chat/completions`; a conversation's
  turns go one after another, each with the whole history (the server's answers included); conversations
  start by the arrival process. User messages are `--prompt-len` random common words.

Arrivals: `--request-rate R` requests (or conversations) per second with gaps drawn from a gamma distribution
of shape `--burstiness` (1: Poisson; below 1 burstier); `inf` sends them all at once. `--max-concurrency`
caps the requests in flight. Several rates make a sweep: one run each, the server idle between them; the
highest throughput measured is the saturation throughput. `--plot-from results.json` draws the plots of a
saved run without sending anything.

Definitions: TTFT, the time to the first chunk with output; ITL, the gaps between later chunks with output
(a chunk may carry several tokens); TPOT, (E2E - TTFT) / (output tokens - 1) per request; goodput, the
requests per second meeting every SLO given (`ttft:MS`, `tpot:MS`, `e2el:MS`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from aioclient import get_metrics, post_stream, wait_idle
from workload import (
    CHAT,
    COMPLETIONS,
    LengthDist,
    make_conversations,
    percentiles,
    random_token_ids,
    request_body,
)

# What each /metrics sample keeps: (our key, the metric's name).
SAMPLED = (
    ("running", "tinypaged:num_requests_running"),
    ("waiting", "tinypaged:num_requests_waiting"),
    ("swapped", "tinypaged:num_requests_swapped"),
    ("kv_usage", "tinypaged:gpu_cache_usage_perc"),
)
SLO_KEYS = {"ttft", "tpot", "e2el"}


@dataclass
class RequestResult:
    """What one request measured (seconds; `start` from the run's start)."""

    start: float
    prompt_len: int
    output_len: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    text: str = field(default="", repr=False)  # choice 0's text: a chat's next turn needs it

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


async def _send(
    session: aiohttp.ClientSession, url: str, body: dict, prompt_len: int, t0: float
) -> RequestResult:
    """One streamed request; a failure is recorded, never raised."""
    result = RequestResult(start=time.perf_counter() - t0, prompt_len=prompt_len)
    begin = time.perf_counter()
    try:
        reply = await post_stream(session, url, body)
        s = reply.stream
        if reply.status != 200:
            result.error = f"HTTP {reply.status}: {reply.body[:200].decode(errors='replace')}"
        elif problems := s.check(max_tokens=body["max_tokens"], exact=body["ignore_eos"]):
            result.error = "; ".join(problems)[:300]
        else:
            result.ttft, result.itl, result.output_len = s.ttft, s.itl, s.output_tokens
            result.prompt_len = s.prompt_tokens if s.prompt_tokens is not None else prompt_len
            result.text = s.text.get(0, "")
    except (aiohttp.ClientError, TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
    result.e2e = time.perf_counter() - begin
    return result


def _gaps(rng: random.Random, n: int, rate: float, burstiness: float) -> list[float]:
    """Gaps between `n` arrivals at `rate` per second: gamma with shape `burstiness` (1: exponential)."""
    if math.isinf(rate):
        return [0.0] * n
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


class Workload:
    """The jobs of one run: each job is one request (random) or one conversation (multi-turn)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        rng = random.Random(args.seed)
        prompt_len, output_len = LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len)
        if args.dataset == "random":
            self.jobs: list = [
                (random_token_ids(rng, prompt_len.sample(rng), args.vocab), output_len.sample(rng))
                for _ in range(args.num_prompts)
            ]
        else:
            turns = LengthDist.parse(args.turns)
            self.jobs = make_conversations(args.num_prompts, turns, prompt_len, output_len, args.seed)

    async def run_job(
        self, session: aiohttp.ClientSession, base: str, job: object, t0: float
    ) -> list[RequestResult]:
        """Send one job's requests; the results in order."""
        a = self.args
        sampling = {"temperature": a.temperature, "ignore_eos": a.ignore_eos}
        if a.dataset == "random":
            prompt, max_tokens = job  # type: ignore[misc]
            body = request_body(COMPLETIONS, prompt, max_tokens, model=a.model, **sampling)
            return [await _send(session, base + COMPLETIONS, body, len(prompt), t0)]
        messages = [{"role": "system", "content": job.system}] if job.system else []  # type: ignore[attr-defined]
        results = []
        for text, max_tokens in zip(job.user_messages, job.output_lens, strict=True):  # type: ignore[attr-defined]
            messages.append({"role": "user", "content": text})
            body = request_body(CHAT, list(messages), max_tokens, model=a.model, **sampling)
            r = await _send(session, base + CHAT, body, sum(len(m["content"].split()) for m in messages), t0)
            results.append(r)
            if r.error is not None:
                break  # the conversation cannot go on without the answer
            messages.append({"role": "assistant", "content": r.text})
        return results


async def _sample_metrics(
    session: aiohttp.ClientSession, base: str, interval: float, t0: float, out: list
) -> None:
    """Append `/metrics` samples (time since the run's start and SAMPLED) every `interval` seconds."""
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            m = await get_metrics(session, base)
            out.append({"t": time.perf_counter() - t0, **{k: m.get(name, 0.0) for k, name in SAMPLED}})
        await asyncio.sleep(interval)


async def run_rate(
    session: aiohttp.ClientSession, args: argparse.Namespace, workload: Workload, rate: float
) -> dict:
    """One run at `rate`: the jobs arrive by the arrival process; returns its summary and samples."""
    base = args.url.rstrip("/")
    rng = random.Random(args.seed + 1)
    gaps = _gaps(rng, len(workload.jobs), rate, args.burstiness)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    samples: list[dict] = []
    t0 = time.perf_counter()

    async def job(j: object) -> list[RequestResult]:
        if limit is None:
            return await workload.run_job(session, base, j, t0)
        async with limit:
            return await workload.run_job(session, base, j, t0)

    sampler = (
        asyncio.create_task(_sample_metrics(session, base, args.metrics_interval, t0, samples))
        if args.metrics_interval > 0
        else None
    )
    tasks = []
    for j, gap in zip(workload.jobs, gaps, strict=True):
        tasks.append(asyncio.create_task(job(j)))
        if gap > 0:
            await asyncio.sleep(gap)
    results = [r for rs in await asyncio.gather(*tasks) for r in rs]
    duration = time.perf_counter() - t0
    if sampler is not None:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    summary = summarize(results, duration, args.goodput)
    run = {"request_rate": rate, "summary": summary, "metrics_samples": samples, "cdf": _cdfs(results)}
    if args.per_request:
        run["requests"] = [
            {k: v for k, v in asdict(r).items() if k != "text"} | {"tpot": r.tpot} for r in results
        ]
    return run


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float] | None = None) -> dict:
    """Throughput, latency percentiles (ms) and goodput of a run, vLLM's measures."""
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [r.tpot for r in ok if r.tpot is not None]
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": percentiles(tpots),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "e2el_ms": percentiles([r.e2e for r in ok]),
    }
    if slos:
        good = [r for r in ok if _meets(r, slos)]
        summary["goodput"] = {
            "slo_ms": slos,
            "good_requests": len(good),
            "request_goodput": len(good) / duration,
        }
    return summary


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2e}
    return all(got[k] is None or got[k] * 1000 <= ms for k, ms in slos.items())  # type: ignore[operator]


def _cdfs(results: list[RequestResult], points: int = 400) -> dict[str, list[float]]:
    """Each latency's sorted values (ms), thinned to at most `points` quantiles, for the CDF plots."""
    ok = [r for r in results if r.error is None]
    raw = {
        "ttft_ms": [r.ttft for r in ok if r.ttft is not None],
        "tpot_ms": [r.tpot for r in ok if r.tpot is not None],
        "itl_ms": [x for r in ok for x in r.itl],
        "e2el_ms": [r.e2e for r in ok],
    }
    out = {}
    for key, values in raw.items():
        xs = sorted(v * 1000 for v in values)
        if len(xs) > points:
            xs = [xs[round(i * (len(xs) - 1) / (points - 1))] for i in range(points)]
        out[key] = [round(x, 3) for x in xs]
    return out


def _saturation(runs: list[dict]) -> dict:
    best = max(runs, key=lambda r: r["summary"]["output_throughput"])
    s = best["summary"]
    return {
        "request_rate": best["request_rate"],
        "output_throughput": s["output_throughput"],
        "request_throughput": s["request_throughput"],
        "total_token_throughput": s["total_token_throughput"],
    }


async def run(args: argparse.Namespace) -> dict:
    """The whole sweep: a check request, then one run per rate, the server idle between them."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)
    workload = Workload(args)
    base = args.url.rstrip("/")
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        async with session.get(base + "/v1/models") as r:
            r.raise_for_status()
            served = (await r.json())["data"][0]["id"]
        args.model = args.model or served
        check = Workload(argparse.Namespace(**{**vars(args), "num_prompts": 1, "seed": args.seed + 7}))
        [first] = (await check.run_job(session, base, check.jobs[0], time.perf_counter()))[:1]
        if first.error is not None:
            raise SystemExit(f"error: the check request failed: {first.error}")
        runs = []
        for rate in args.request_rate:
            if args.metrics_interval > 0:
                await wait_idle(session, base, timeout=120)
            runs.append(await run_rate(session, args, workload, rate))
            print(_row(runs[-1]), file=sys.stderr, flush=True)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "out", "plot_dir", "plot_from")}
    return {"config": config, "runs": runs, "saturation": _saturation(runs)}


def _fmt_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _row(run: dict) -> str:
    s = run["summary"]
    peak = max((x["kv_usage"] for x in run["metrics_samples"]), default=float("nan"))
    waiting = max((x["waiting"] for x in run["metrics_samples"]), default=float("nan"))
    good = s.get("goodput", {}).get("request_goodput")

    def pq(key: str) -> str:
        d = s[key]
        return f"{d['median']:.1f} / {d['p99']:.1f}" if d else "-"

    return (
        f"| {_fmt_rate(run['request_rate'])} | {s['completed']} / {s['failed']} | {s['request_throughput']:.2f} | "
        f"{s['output_throughput']:.0f} | {pq('ttft_ms')} | {pq('tpot_ms')} | {pq('itl_ms')} | "
        f"{s['e2el_ms'].get('median', float('nan')):.0f} | {'-' if good is None else f'{good:.2f}'} | "
        f"{peak * 100:.1f}% | {waiting:.0f} |"
    )


def table(result: dict) -> str:
    """The sweep as a markdown table (ms; goodput in requests/s)."""
    head = (
        "| rate | ok / failed | req/s | out tok/s | TTFT p50 / p99 | TPOT p50 / p99 | ITL p50 / p99 | E2E p50 | "
        "goodput | peak KV | peak waiting |\n|" + "---|" * 11
    )
    sat = result["saturation"]
    tail = (
        f"saturation: {sat['output_throughput']:.0f} output tok/s, {sat['request_throughput']:.2f} req/s "
        f"(rate {_fmt_rate(sat['request_rate'])})"
    )
    return "\n".join([head, *(_row(r) for r in result["runs"]), tail])


def plot(result: dict, out_dir: str | Path) -> list[Path]:
    """Latency CDFs, throughput against latency across the sweep, KV usage and queues over time (PNGs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = result["runs"]
    label = [f"rate {_fmt_rate(r['request_rate'])}" for r in runs]
    paths = []

    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    for ax, (key, title) in zip(
        axes.flat,
        [("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")],
        strict=True,
    ):
        for run, name in zip(runs, label, strict=True):
            xs = run["cdf"][key]
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        ax.set(
            title=title, xlabel="ms", ylabel="fraction of requests" if key != "itl_ms" else "fraction of gaps"
        )
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    paths.append(_save(fig, out / "latency_cdf.png"))

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    tput = [r["summary"]["output_throughput"] for r in runs]
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms"), ("TTFT", "TPOT"), strict=True):
        for q, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(tput, [r["summary"][key].get(q, math.nan) for r in runs], style, label=q)
        for x, r in zip(tput, runs, strict=True):
            ax.annotate(_fmt_rate(r["request_rate"]), (x, r["summary"][key].get("p99", math.nan)), fontsize=7)
        ax.set(title=f"{title} against throughput", xlabel="output tok/s", ylabel="ms")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    paths.append(_save(fig, out / "throughput_latency.png"))

    fig, axes = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    for run, name in zip(runs, label, strict=True):
        t = [x["t"] for x in run["metrics_samples"]]
        (line,) = axes[0].plot(t, [100 * x["kv_usage"] for x in run["metrics_samples"]], label=name)
        axes[1].plot(t, [x["running"] for x in run["metrics_samples"]], color=line.get_color())
        axes[1].plot(t, [x["waiting"] for x in run["metrics_samples"]], "--", color=line.get_color())
    axes[0].set(ylabel="KV cache used (%)", title="KV cache and queues over each run")
    axes[1].set(ylabel="requests: running (solid), waiting (dashed)", xlabel="seconds since the run's start")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    paths.append(_save(fig, out / "kv_and_queues.png"))
    return paths


def _save(fig: object, path: Path) -> Path:
    fig.tight_layout()  # type: ignore[attr-defined]
    fig.savefig(path, dpi=72)  # type: ignore[attr-defined]
    import matplotlib.pyplot as plt

    plt.close(fig)  # type: ignore[arg-type]
    return path


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 or inf, got {text}")
    return value


def _length(values: list[str]) -> str:
    """`--prompt-len SPEC`, or the older `MIN MAX` (uniform)."""
    spec = "-".join(values) if len(values) == 2 else values[0]
    LengthDist.parse(spec)
    return spec


def _slos(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, _, ms = item.partition(":")
        if key not in SLO_KEYS or not ms:
            raise SystemExit(
                f"error: --goodput takes KEY:MS with KEY one of {sorted(SLO_KEYS)}, got {item!r}"
            )
        out[key] = float(ms)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options (vLLM's names where it has them)."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", "--base-url", dest="url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--api-key", default=None)
    ap.add_argument(
        "--dataset", "--dataset-name", dest="dataset", choices=("random", "multi-turn"), default="random"
    )
    ap.add_argument("--num-prompts", "--num-requests", dest="num_prompts", type=int, default=100)
    ap.add_argument(
        "--prompt-len", nargs="+", default=["32-256"], help="length spec (tokens; words for multi-turn)"
    )
    ap.add_argument("--output-len", nargs="+", default=["16-128"], help="length spec (tokens)")
    ap.add_argument("--turns", default="2-6", help="multi-turn: turns per conversation (length spec)")
    ap.add_argument("--vocab", type=int, default=32000, help="random prompt ids are drawn below this")
    ap.add_argument(
        "--request-rate", type=_rate, nargs="+", default=[math.inf], help="one or more; inf: all at once"
    )
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS"
    )
    ap.add_argument(
        "--metrics-interval", type=float, default=0.5, help="seconds between /metrics samples; 0: none"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--per-request", action="store_true", help="keep every request's measurements in the JSON"
    )
    ap.add_argument("--out", default=None, help="write the JSON results here")
    ap.add_argument("--plot-dir", default=None, help="write the PNG plots here")
    ap.add_argument("--plot-from", default=None, help="plot a saved JSON result (to --plot-dir) and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the sweep (or plot a saved one), print the table, write JSON and plots."""
    args = build_parser().parse_args(argv)
    if args.plot_from:
        result = json.loads(Path(args.plot_from).read_text())
    else:
        try:
            args.prompt_len, args.output_len = _length(args.prompt_len), _length(args.output_len)
            LengthDist.parse(args.turns)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from e
        args.goodput = _slos(args.goodput)
        result = asyncio.run(run(args))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot_dir:
        for path in plot(result, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    print(table(result))
    return 1 if any(r["summary"]["failed"] for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
