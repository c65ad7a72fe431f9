"""BENCHMARKS.md's plots, drawn from the JSON in benchmarks/results (no figure is typed in here):

    python3 benchmarks/plots.py            # writes benchmarks/img/*.png

- w1_roofline.png: W1 offline greedy against its strict roofline and per-op floor, run by run (the whole tables
  of `serving_speed.py` and the boards of `energy.py`), with the 80% target.
- http_latency.png: the latest whole table's TTFT and ITL percentiles, burst and Poisson, against their targets;
  the burst's throughput against offline, engine-core process and in-process servers.
- tp_scaling.png: TP=2 against TP=1 in the latest run, and the ratio across the runs of the code as merged.
- peers.png: tinypaged against HF transformers in the same run, the CPU default model and W1 on the H200 (the
  results hold no llama.cpp run yet).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
IMG = ROOT / "img"
DPI = 100

# Whole-table calls of serving_speed.py are saved as serving-speed-h200-runN.json (variants carry a suffix).
WHOLE_TABLE = re.compile(r"^serving-speed-h200-run(\d+)\.json$")
ENERGY = re.compile(r"^energy-h200-run(\d+)(?:-draft)?\.json$")
# Tensor-parallel files of the code as merged at the time (HISTORY.md's "Summary against the targets" quotes
# these); the others measured variants that were dropped, or symmetric memory's rules while they were chosen.
TP_MERGED = (
    "tensor-parallel-h200x2.json",
    "-run2.json",
    "-run7-2-final-only",
    "-run7-4-final-only",
    "-run8-2-async-plan",
    "-run9.json",
    "-run10-1-main",
    "-run10-3-main",
    "-run11-longest-first",
    "-run12-1-pdl",
    "-run12-3-pdl",
    "-run12-w1-pdl",
    "-run13.json",
)


def load(name: str) -> dict[str, Any]:
    """One result file."""
    return json.loads((RESULTS / name).read_text())


def run_number(name: str) -> int:
    """The run a result file names (`...-run13-...` -> 13; the first, unnumbered, is run 1)."""
    m = re.search(r"-run(\d+)", name)
    return int(m.group(1)) if m else 1


def w1_points() -> tuple[list[tuple[int, float, float, float]], list[tuple[int, float, float, float]]]:
    """(run, share of the strict roofline, share of the per-op floor, tok/s) for every whole table and every
    energy run's W1."""
    tables, boards = [], []
    for path in sorted(RESULTS.glob("serving-speed-h200-run*.json")):
        m = WHOLE_TABLE.match(path.name)
        data = load(path.name)
        if not m or "latency" not in data or "greedy" not in data.get("offline", {}):
            continue
        greedy, roof = data["offline"]["greedy"], data["roofline"]
        elapsed = greedy["elapsed_s"]
        tables.append(
            (
                int(m.group(1)),
                roof["total_strict_s"] / elapsed,
                roof["total_per_op_s"] / elapsed,
                greedy["output_tokens_per_s"],
            )
        )
    for path in sorted(RESULTS.glob("energy-h200-run*.json")):
        m = ENERGY.match(path.name)
        w1 = load(path.name).get("w1") if m else None
        if not w1:
            continue
        # The draft (run 55) saved a list of runs, each with its roofline; the script since saves the bounds once.
        runs = w1 if isinstance(w1, list) else w1["runs"]
        bounds = {} if isinstance(w1, list) else w1["bounds"]
        for run in runs:
            strict = bounds.get("strict_s", run.get("roofline_s"))
            per_op = bounds.get("per_op_s")
            boards.append(
                (
                    int(m.group(1)),
                    strict / run["elapsed_s"],
                    per_op / run["elapsed_s"] if per_op else float("nan"),
                    run["tok_s"],
                )
            )
    return tables, boards


def plot_w1() -> Path:
    """W1 offline greedy, share of the strict roofline and of the per-op floor, run by run."""
    tables, boards = w1_points()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for points, marker, label in (
        (tables, "o", "whole table (serving_speed.py)"),
        (boards, "s", "one board (energy.py)"),
    ):
        runs = [p[0] for p in points]
        ax.scatter(
            runs,
            [100 * p[1] for p in points],
            marker=marker,
            color="tab:blue",
            label=f"strict roofline, {label}",
        )
        per_op = [(p[0], 100 * p[2]) for p in points if p[2] == p[2]]
        ax.scatter(
            [r for r, _ in per_op], [v for _, v in per_op], marker=marker, facecolors="none",
            edgecolors="tab:gray", label=f"per-op floor, {label}",
        )  # fmt: skip
    ax.axhline(80, color="tab:red", linestyle="--", linewidth=1)
    ax.text(1, 80.3, "target: 80% of the strict roofline", color="tab:red", fontsize=8)
    last = max(tables + boards, key=lambda p: p[0])
    ax.annotate(
        f"run {last[0]}: {last[3]:.0f} tok/s",
        (last[0], 100 * last[1]),
        textcoords="offset points",
        xytext=(-95, -35),
        fontsize=8,
        arrowprops={"arrowstyle": "-", "color": "0.5"},
    )
    ax.set_xlabel("run (each call a fresh host; one H200, 8B shape, bf16, random weights)")
    ax.set_ylabel("% of the bound (W1 time)")
    ax.set_title("W1 offline, greedy: share of its roofline, run by run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return save(fig, "w1_roofline.png")


def latest_whole_table() -> tuple[int, dict[str, Any]]:
    """The highest-numbered whole table with a server part."""
    best = None
    for path in RESULTS.glob("serving-speed-h200-run*.json"):
        m = WHOLE_TABLE.match(path.name)
        if m and "server" in (data := load(path.name)) and "latency" in data:
            if best is None or int(m.group(1)) > best[0]:
                best = (int(m.group(1)), data)
    assert best is not None, "no whole table in benchmarks/results"
    return best


def plot_http() -> Path:
    """The latest whole table's latency percentiles, and the burst against offline in both server kinds."""
    run, data = latest_whole_table()
    server = data["server"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    groups = [
        ("burst ITL", server["burst"]["itl"], 40),
        ("Poisson ITL", server["poisson"]["itl"], 25),
        ("Poisson TTFT", server["poisson"]["ttft"], 100),
    ]
    width = 0.25
    for i, (_, pcts, target) in enumerate(groups):
        for j, (key, color) in enumerate(
            (("p50_ms", "tab:blue"), ("mean_ms", "tab:cyan"), ("p99_ms", "tab:orange"))
        ):
            x = i + (j - 1) * width
            left.bar(x, pcts[key], width, color=color, label=key.split("_")[0] if i == 0 else None)
            left.text(x, pcts[key], f"{pcts[key]:.1f}", ha="center", va="bottom", fontsize=7)
        left.hlines(target, i - 1.5 * width, i + 1.5 * width, colors="tab:red", linestyles="--")
    left.plot([], [], color="tab:red", linestyle="--", label="p99 target")
    left.set_xticks(range(len(groups)), [g[0] for g in groups])
    left.set_ylabel("ms")
    burst_ttft = server["burst"]["ttft"]
    left.set_title(
        f"run {run}: 256 streams at once, and Poisson 16 req/s\n"
        f"(the burst's TTFT p50 / p99: {burst_ttft['p50_ms']:.0f} / {burst_ttft['p99_ms']:.0f} ms)",
        fontsize=9,
    )
    left.legend(fontsize=7, loc="upper left")
    left.grid(axis="y", alpha=0.3)

    core, inproc = [], []
    for path in sorted(RESULTS.glob("serving-speed-h200-run*.json")):
        m = WHOLE_TABLE.match(path.name)
        d = load(path.name) if m else {}
        if "server" not in d or "offline_greedy" not in d["server"] or run_number(path.name) < 31:
            continue
        offline = d["server"]["offline_greedy"]["output_tokens_per_s"]
        core.append((int(m.group(1)), 100 * d["server"]["burst"]["output_tokens_per_s"] / offline))
        if "server_in_process" in d:
            inproc.append(
                (int(m.group(1)), 100 * d["server_in_process"]["burst"]["output_tokens_per_s"] / offline)
            )
    core.sort()
    inproc.sort()
    right.plot(
        [r for r, _ in core], [v for _, v in core], "o-", label="engine core in its own process (default)"
    )
    if inproc:
        right.plot(
            [r for r, _ in inproc], [v for _, v in inproc], "s--", label="engine in the server's process"
        )
    right.axhline(95, color="tab:red", linestyle="--", linewidth=1)
    right.text(core[0][0], 95.3, "target 95%", color="tab:red", fontsize=8)
    right.set_xlabel("run")
    right.set_ylabel("% of offline W1 at 512 tokens a step")
    both = f"\n(runs {inproc[0][0]}-{inproc[-1][0]} ran both servers)" if inproc else ""
    right.set_title(f"the burst's throughput against offline, same call{both}", fontsize=9)
    right.legend(fontsize=7, loc="lower right")
    right.set_ylim(bottom=min(v for _, v in core + inproc) - 2)
    right.grid(alpha=0.3)
    return save(fig, "http_latency.png")


def plot_tp() -> Path:
    """TP=2 against TP=1: the latest run's tok/s, and the ratio run by run."""
    files = sorted(
        (p.name for p in RESULTS.glob("tensor-parallel-h200x2*.json") if any(f in p.name for f in TP_MERGED)),
        key=run_number,
    )
    ratios: dict[str, list[tuple[int, float]]] = {"W1": [], "batch-1 decode": []}
    latest: dict[str, Any] = {}
    for name in files:
        d = load(name)
        one, two = d.get("tp1", {}), d.get("tp2", {})
        w = [x.get("w1", {}).get("output_tokens_per_s") for x in (one, two)]
        b = [x.get("latency", {}).get("graphs", {}).get("decode_tokens_per_s") for x in (one, two)]
        if all(w):
            ratios["W1"].append((run_number(name), w[1] / w[0]))
        if all(b):
            ratios["batch-1 decode"].append((run_number(name), b[1] / b[0]))
        if all(w) and all(b):
            latest = {"run": run_number(name), "W1": w, "batch-1 decode": b}
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1, 1, 2]})
    for ax, key, unit in ((axes[0], "W1", "output tok/s"), (axes[1], "batch-1 decode", "tok/s")):
        one, two = latest[key]
        ax.bar(["TP=1", "TP=2"], [one, two], color=["tab:gray", "tab:blue"])
        for x, v in enumerate((one, two)):
            ax.text(x, v, f"{v:.0f}" if v > 1000 else f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{key}, run {latest['run']}: {two / one:.2f}x", fontsize=9)
        ax.set_ylabel(unit)
    ax = axes[2]
    for (key, points), expected in zip(ratios.items(), (1.5, 1.6), strict=True):
        points.sort()
        (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=key)
        ax.axhline(expected, color=line.get_color(), linestyle=":", linewidth=1)
        ax.text(points[0][0], expected + 0.01, f"expected {expected}x", color=line.get_color(), fontsize=7)
    ax.set_ylim(top=1.65)  # room for the expectations' labels
    ax.set_xlabel("run (two H200s over NVLink; the code as merged at the time)")
    ax.set_ylabel("TP=2 / TP=1, same run")
    ax.set_title("tensor-parallel scaling, run by run", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    return save(fig, "tp_scaling.png")


def plot_peers() -> Path:
    """tinypaged against HF transformers in the same run: the CPU default model, and W1 on the H200."""
    cpu = load("cpu_throughput.json")
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    bars = [("tinypaged,\n32 batched", cpu["ours"]["output_tokens_per_s"]),
            ("HF generate(),\none at a time", cpu["hf_one_at_a_time"]["output_tokens_per_s"])]  # fmt: skip
    left.bar([b[0] for b in bars], [b[1] for b in bars], color=["tab:blue", "tab:gray"])
    for x, (_, v) in enumerate(bars):
        left.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    left.set_ylabel("output tok/s")
    left.set_title(
        f"CPU, default model (float32), {cpu['date']}: {cpu['speedup']:.1f}x\n"
        "(no llama.cpp run in benchmarks/results yet)",
        fontsize=9,
    )
    names, ours, hf = [], [], []
    for name in ("throughput-h200.json", "throughput-h200-run3.json"):
        d = load(name)
        if "hf_static" in d:
            names.append(f"run {run_number(name)}\n{d['date']}")
            ours.append(d["ours"]["output_tokens_per_s"])
            hf.append(d["hf_static"]["output_tokens_per_s"])
    xs = range(len(names))
    right.bar([x - 0.2 for x in xs], ours, 0.4, label="tinypaged", color="tab:blue")
    right.bar([x + 0.2 for x in xs], hf, 0.4, label="HF static generate(), batch 64", color="tab:gray")
    for x, (a, b) in enumerate(zip(ours, hf, strict=True)):
        right.text(x - 0.2, a, f"{a:.0f}", ha="center", va="bottom", fontsize=8)
        right.text(x + 0.2, b, f"{b:.0f}\n({a / b:.1f}x)", ha="center", va="bottom", fontsize=8)
    right.set_xticks(list(xs), names)
    right.set_ylabel("output tok/s")
    right.set_title("W1 on one H200, 8B shape, same process", fontsize=9)
    right.legend(fontsize=7)
    return save(fig, "peers.png")


def save(fig: Any, name: str) -> Path:
    """Write one figure as a small PNG."""
    IMG.mkdir(exist_ok=True)
    path = IMG / name
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def main() -> None:
    for plot in (plot_w1, plot_http, plot_tp, plot_peers):
        path = plot()
        print(f"{path.relative_to(ROOT.parent)}: {path.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
