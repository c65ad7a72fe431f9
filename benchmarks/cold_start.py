"""Cold start (issue 44): `tinypaged serve` started on an empty compile cache (a fresh TRITON_CACHE_DIR), its
ready time (process start to /health's first 200) and startup phases (/metrics'
tinypaged:startup_phase_seconds), then per sampling variant the latency of its first request after ready and of
its second; then the same after a restart with the compile cache kept. Each of the two runs --tries times
(fresh servers); medians are reported. Targets (BENCHMARKS.md): ready <= 40 s on empty caches and <= 20 s
with the cache kept; after ready, each variant's first request <= 1.5x its second.

    tinypaged weights random --config llama-3.1-8b --out /tmp/llama-3.1-8b
    python benchmarks/cold_start.py --model /tmp/llama-3.1-8b --json benchmarks/results/cold_start-h200.json
    python benchmarks/cold_start.py --device cpu --tries 1 --max-tokens 4 --offline-requests 4   # CPU smoke

Offline (issue 44's third target): in a fresh process on an empty compile cache, LLM(...) built, then W1 sampled
(temperature 0.8, top-p 0.95, a seed per request) as its first work, then W1 greedy: sampled >= 95% of greedy.

Structured outputs: every request (first and second alike) follows a JSON schema never seen before (a fresh
property name), so both pay the grammar's own compile and their ratio shows the kernels alone. The page cache:
weights a previous start read may come from memory, not disk; --drop-caches drops it before each start (root
only; the JSON says whether it was dropped) and the weights phase's seconds say which it was.

Each server's log goes to a file beside the JSON (the tail is printed when a start or a request fails); a server
that does not answer within --start-timeout, or a request past --request-timeout, ends that run with a clear
error while the rest goes on; the table is printed last and the JSON written after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from tinypaged.server.local import LocalServer

PROMPT = "The history of the printing press begins"
# The request body of each sampling variant (completions API, vLLM's extras); "structured" gets a new schema.
VARIANTS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top_p": {"temperature": 0.8, "top_p": 0.9},
    "top_k": {"temperature": 0.8, "top_k": 20},
    "min_p": {"temperature": 0.8, "min_p": 0.05},
    "penalties": {
        "temperature": 0.8,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
    },
    "min_tokens": {"temperature": 0.8, "min_tokens": 2},
    "seed": {"temperature": 0.8, "seed": 1},
    "logprobs": {"temperature": 0.8, "logprobs": 5},
    "prompt_logprobs": {"temperature": 0.0, "echo": True, "logprobs": 1},
    "n_best_of": {"temperature": 0.8, "n": 2, "best_of": 3},
    "beam_search": {"temperature": 0.0, "n": 2, "use_beam_search": True},
    "structured": {"temperature": 0.8},
}
RATIO_TARGET = 1.5
READY_TARGETS = {"fresh": 40.0, "cached": 20.0}


def schema() -> dict[str, Any]:
    """A JSON schema no server has seen: its property name is new each time."""
    name = "k" + uuid.uuid4().hex[:12]
    return {"json": {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}}


def post(url: str, body: dict[str, Any], timeout: float) -> float:
    """Seconds one non-streamed completion took; RuntimeError with the server's answer if it failed."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/completions", data, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read()[:300]!r}") from None
    except TimeoutError:
        raise RuntimeError(f"no answer within {timeout:.0f} s") from None
    elapsed = time.perf_counter() - t0
    if not answer.get("choices"):
        raise RuntimeError(f"no choices in {str(answer)[:300]}")
    return elapsed


def startup_phases(url: str) -> dict[str, float]:
    """tinypaged:startup_phase_seconds by phase, from /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    phases = {}
    for line in text.splitlines():
        if line.startswith("tinypaged:startup_phase_seconds{"):
            labels, value = line.rsplit(" ", 1)
            phases[labels.split('phase="')[1].split('"')[0]] = float(value)
    return phases


def drop_page_cache() -> str:
    """Drop the kernel's page cache (root only): "dropped", or why not."""
    try:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "dropped"
    except OSError as e:
        return f"kept ({e.strerror or e})"


def count_kernels(cache: Path) -> int:
    return sum(1 for e in cache.iterdir() if e.is_dir()) if cache.is_dir() else 0


def one_start(args: argparse.Namespace, cache: Path, log: Path) -> dict[str, Any]:
    """Start a server on `cache`, time its readiness, then each variant's first and second request."""
    out: dict[str, Any] = {"kernels_before": count_kernels(cache)}
    out["page_cache"] = drop_page_cache() if args.drop_caches else "not dropped"
    serve = ["--model", str(args.model), "--device", args.device, *args.serve_args]
    env = {"TRITON_CACHE_DIR": str(cache)}
    with LocalServer(serve, start_timeout=args.start_timeout, env=env, log=log) as server:
        out["ready_s"] = server.ready_s
        out["kernels_at_ready"] = count_kernels(cache)
        out["phases"] = startup_phases(server.url)
        out["requests"] = {}
        for name, extra in VARIANTS.items():
            times = []
            for _ in range(2):
                body = {"prompt": PROMPT, "max_tokens": args.max_tokens, "ignore_eos": True, **extra}
                if name == "structured":
                    body["structured_outputs"] = schema()
                    body.pop("ignore_eos")
                try:
                    times.append(post(server.url, body, args.request_timeout))
                except (RuntimeError, OSError) as e:
                    out["requests"][name] = {"error": str(e)}
                    print(f"  {name}: {e}", file=sys.stderr)
                    break
            else:
                out["requests"][name] = {"first_s": times[0], "second_s": times[1]}
    # Kernels compiled after ready (by the requests): what the warm-up missed.
    out["kernels_after"] = count_kernels(cache)
    return out


def median_of(runs: list[dict[str, Any]], *path: str) -> float | None:
    values = []
    for run in runs:
        v: Any = run
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if isinstance(v, int | float):
            values.append(float(v))
    return statistics.median(values) if values else None


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Medians over the tries of each run, with the targets' verdicts."""
    summary: dict[str, Any] = {}
    for run in ("fresh", "cached"):
        runs = [t[run] for t in res["tries"] if isinstance(t.get(run), dict) and "ready_s" in t[run]]
        if not runs:
            continue
        s: dict[str, Any] = {"ready_s": median_of(runs, "ready_s"), "tries": len(runs)}
        s["ready_ok"] = s["ready_s"] is not None and s["ready_s"] <= READY_TARGETS[run]
        s["phases"] = {p: median_of(runs, "phases", p) for p in runs[0].get("phases", {})}
        s["kernels_at_ready"] = median_of(runs, "kernels_at_ready")
        s["kernels_compiled_by_requests"] = max(r["kernels_after"] - r["kernels_at_ready"] for r in runs)
        s["page_cache"] = sorted({r["page_cache"] for r in runs})
        s["variants"] = {}
        for name in VARIANTS:
            first = median_of(runs, "requests", name, "first_s")
            second = median_of(runs, "requests", name, "second_s")
            ratio = first / second if first is not None and second else None
            s["variants"][name] = {
                "first_s": first,
                "second_s": second,
                "ratio": ratio,
                "ok": ratio is not None and ratio <= RATIO_TARGET,
            }
        summary[run] = s
    return summary


def table(summary: dict[str, Any]) -> str:
    def f(v: float | None, fmt: str = "{:.3f}") -> str:
        return "-" if v is None else fmt.format(v)

    lines = []
    for run, s in summary.items():
        verdict = "ok" if s["ready_ok"] else f"MISSED (target {READY_TARGETS[run]:.0f} s)"
        phases = ", ".join(f"{k} {f(v, '{:.1f}')}" for k, v in s["phases"].items())
        lines.append(f"{run} cache: ready {f(s['ready_s'], '{:.1f}')} s {verdict}; phases (s): {phases}")
        lines.append(
            f"  kernels in the cache at ready {f(s['kernels_at_ready'], '{:.0f}')}, compiled by requests after it "
            f"{s['kernels_compiled_by_requests']} (target 0); page cache {', '.join(s['page_cache'])}"
        )
        lines.append(
            f"  {'variant':<16}{'first s':>10}{'second s':>10}{'ratio':>8}  target <= {RATIO_TARGET}x"
        )
        for name, v in s["variants"].items():
            mark = "ok" if v["ok"] else "MISSED"
            lines.append(
                f"  {name:<16}{f(v['first_s']):>10}{f(v['second_s']):>10}{f(v['ratio'], '{:.2f}'):>8}  {mark}"
            )
    return "\n".join(lines)


def offline_child(args: argparse.Namespace) -> int:
    """In a fresh process (its own empty compile cache): LLM(...) built, then W1 sampled (temperature 0.8,
    top-p 0.95, a seed per request) as the process's first work, then W1 greedy; tokens/s of each as JSON."""
    sys.path.insert(0, str(Path(__file__).parent))
    from common import make_workload  # the benchmarks' W1

    from tinypaged import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, device=args.device, max_model_len=2048, max_num_batched_tokens=8192)
    ready_s = time.perf_counter() - t0
    vocab = llm.config.model_config.vocab_size
    small = args.device == "cpu"  # a smoke check: W1's shape, scaled down
    work = make_workload(
        args.offline_requests,
        vocab,
        prompt=(16, 64) if small else (64, 1024),
        output=(8, 16) if small else (32, 512),
    )
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    out: dict[str, Any] = {"ready_s": ready_s, "startup": dict(llm.engine.startup)}
    for name, temp in (("sampled", 0.8), ("greedy", 0.0)):
        params = [
            SamplingParams(temperature=temp, top_p=0.95 if temp else 1.0, seed=i if temp else None,
                           max_tokens=o, ignore_eos=True)
            for i, (_, o) in enumerate(work)
        ]  # fmt: skip
        # The second run would find the first's prompts in the prefix cache and skip their prefill (run 71:
        # W1 ran 1.6x faster the second time in a process, whatever its sampling); each run starts empty.
        assert llm.reset_prefix_cache()
        t0 = time.perf_counter()
        done = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        out[name] = {"s": elapsed, "tokens_per_s": sum(len(d.outputs[0].token_ids) for d in done) / elapsed}
    out["sampled_over_greedy"] = out["sampled"]["tokens_per_s"] / out["greedy"]["tokens_per_s"]
    print(json.dumps(out))
    return 0


def offline(args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """`offline_child` in a process of its own on an empty compile cache, with the start timeout."""
    cache = Path(tempfile.mkdtemp(prefix="cold-start-triton-"))
    cmd = [sys.executable, __file__, "--offline-child", "--device", args.device, "--model", str(args.model)]
    cmd += ["--offline-requests", str(args.offline_requests)]
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    with log.open("w") as err:
        done = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, timeout=args.start_timeout
        )
    if done.returncode != 0:
        raise RuntimeError(f"the offline run exited with {done.returncode}: see {log}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["ok"] = result["sampled_over_greedy"] >= 0.95
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tries", type=int, default=3, help="fresh servers per run (medians are reported)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--start-timeout", type=float, default=600.0, help="seconds a server may take to be ready"
    )
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each start (root)")
    ap.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="more `tinypaged serve` flags")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--offline-requests",
        type=int,
        default=256,
        help="W1's size for the offline run: the first sampled W1 of a fresh process against greedy (0: skip)",
    )
    ap.add_argument("--offline-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.offline_child:
        return offline_child(args)
    if args.model is None:
        from tinypaged.weights.fetch import resolve_model

        args.model = resolve_model(None)
    out = Path(args.json) if args.json else None
    logs = Path(tempfile.mkdtemp(prefix="cold-start-logs-")) if out is None else out.with_suffix(".logs")
    logs.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "tries": [], "logs": str(logs)}
    res["summary"] = {}
    for i in range(args.tries):
        cache = Path(tempfile.mkdtemp(prefix="cold-start-triton-"))  # empty: a fresh machine's
        entry: dict[str, Any] = {"cache": str(cache)}
        res["tries"].append(entry)
        for run in ("fresh", "cached"):  # the second start keeps the first's compile cache
            log = logs / f"try{i}-{run}.log"
            print(f"try {i + 1}/{args.tries}: {run} compile cache, log {log}", file=sys.stderr, flush=True)
            try:
                entry[run] = one_start(args, cache, log)
            except Exception as e:  # noqa: BLE001 - one failed start ends its run, not the benchmark
                entry[run] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                tail = log.read_text().splitlines()[-30:] if log.exists() else []
                print(f"  {run} start failed: {e}\n  " + "\n  ".join(tail), file=sys.stderr)
                break
            finally:
                res["summary"] = summarize(res)
                if out is not None:
                    out.write_text(json.dumps(res, indent=2) + "\n")
    if args.offline_requests:
        log = logs / "offline.log"
        print(f"offline: W1 sampled, then greedy, in a fresh process; log {log}", file=sys.stderr, flush=True)
        try:
            res["offline"] = offline(args, log)
        except Exception as e:  # noqa: BLE001 - reported, the rest stands
            res["offline"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  offline run failed: {e}", file=sys.stderr)
        if out is not None:
            out.write_text(json.dumps(res, indent=2) + "\n")
    print(table(res["summary"]))
    off = res.get("offline")
    if off and "error" not in off:
        mark = "ok" if off["ok"] else "MISSED"
        print(
            f"offline, fresh process: first sampled W1 {off['sampled']['tokens_per_s']:.0f} tok/s, greedy "
            f"{off['greedy']['tokens_per_s']:.0f} tok/s: {off['sampled_over_greedy']:.3f} of greedy (target >= 0.95) "
            f"{mark}; LLM ready in {off['ready_s']:.1f} s"
        )
    elif off:
        print(f"offline: {off['error']}")
    if out is not None:
        print(f"wrote {out}")
    return 0 if res["summary"] or "error" not in res.get("offline", {"error": ""}) else 1


if __name__ == "__main__":
    sys.exit(main())
