"""The paper evaluation's figures, drawn from the JSON of `paper_eval.py` runs (no figure is typed in here):

    python benchmarks/paper_plots.py benchmarks/results/paper-*.json --out docs/img

The files are merged (the sections usually run as separate commands: rates per workload, sharing, block
sizes, kernels; a later file's section replaces an earlier one's). Each figure is drawn when its section is
there:
- paper_latency_vs_rate.png: mean normalized latency against request rate, a line per policy, a panel per
  workload, with each policy's bound (the paper's Fig. 12);
- paper_batch_kv_over_time.png: sequences in the batch and KV blocks in use over time, at each workload's
  highest sustained rate (Fig. 13 shows the mean batch);
- paper_kv_waste.png: KV waste at the peak of block use by policy, at each policy's highest sustained rate
  (Fig. 2);
- paper_sharing.png: blocks saved by sharing, parallel sampling and beam search by width (Fig. 15);
- paper_block_size.png: end-to-end normalized latency (a line per workload and rate, from every file that
  has block sizes), and the decode kernel's time, against block size (Fig. 18);
- paper_kernels.png: the paged kernel against SDPA over a contiguous cache, per decode batch (Fig. 18a).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DPI = 100
INF = float("inf")


def merge(paths: list[Path]) -> dict[str, Any]:
    """One result from several files: rate sweeps merged by policy and workload (a later file's runs join an
    earlier sweep's, replacing a run at the same rate, and the sustained rate is found again under the first
    sweep's bound), other sections replaced. Give it the files of one model and one KV capacity."""
    out: dict[str, Any] = {"rates": {}}
    for path in paths:
        res = json.loads(path.read_text())
        for policy, by_name in res.get("rates", {}).items():
            if "error" in by_name:
                continue
            for name, sweep in by_name.items():
                if "error" in sweep:
                    continue
                have = out["rates"].setdefault(policy, {}).get(name)
                out["rates"][policy][name] = sweep if have is None else join_sweeps(have, sweep)
        for size, row in res.get("block_sizes", {}).items():
            if "error" in row:
                continue
            for name, run in row.items():  # a series per workload and rate: files at other rates join
                if isinstance(run, dict) and "mean_norm_latency_s" in run:
                    label = (
                        f"{name}, {run['rate']:g} req/s" if run.get("rate", INF) < INF else f"{name}, at once"
                    )
                    out.setdefault("block_sizes", {}).setdefault(size, {})[label] = run
        for key in ("sharing", "kernels", "device"):
            if key in res and "error" not in res[key]:
                out[key] = res[key]
    return out


def join_sweeps(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Sweep `a` with `b`'s runs added (b's replaces a's at the same rate), its sustained rate found again under
    a's bound (b's where a had none), as paper_eval.py finds it."""
    from paper_eval import sustained  # imports the engine: only when sweeps are joined

    runs = {r["rate"]: r for r in a["runs"]}
    runs.update({r["rate"]: r for r in b["runs"]})
    ordered = [runs[r] for r in sorted(runs)]
    bound = a["sustained"]["bound_s_per_token"] or b["sustained"]["bound_s_per_token"]
    return {**a, "runs": ordered, "sustained": sustained(ordered, bound, 2.0)}


def latency_vs_rate(res: dict[str, Any], out: Path) -> None:
    """Normalized latency against rate, a panel per workload; a log scale, so that a policy far over the
    bound (orca-max) leaves the others' knees readable."""
    names = sorted({n for by_name in res["rates"].values() for n in by_name})
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for policy, by_name in res["rates"].items():
            if name not in by_name:
                continue
            runs = sorted(by_name[name]["runs"], key=lambda r: r["rate"])
            line = ax.plot(
                [r["rate"] for r in runs], [1e3 * r["mean_norm_latency_s"] for r in runs], "o-", label=policy
            )
            bound = by_name[name]["sustained"]["bound_s_per_token"]
            if bound:
                ax.axhline(1e3 * bound, ls="--", lw=0.8, color=line[0].get_color())
        ax.set(title=f"{name} shape", xlabel="request rate (req/s)", ylabel="normalized latency (ms/token)")
        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "paper_latency_vs_rate.png", dpi=DPI)
    plt.close(fig)


def batch_over_time(res: dict[str, Any], out: Path) -> None:
    """Batch and KV use over time at the highest sustained rate (else the lowest rate), policy "paged"."""
    sweeps = res["rates"].get("paged", {})
    fig, axes = plt.subplots(1, len(sweeps), figsize=(5.5 * len(sweeps), 4), squeeze=False)
    for ax, (name, sweep) in zip(axes[0], sweeps.items(), strict=True):
        best = sweep["sustained"]["max_rate"]
        runs = sorted(sweep["runs"], key=lambda r: r["rate"])
        run = next((r for r in runs if r["rate"] == best), runs[0])
        s = run["series"]
        ax.plot(s["t_s"], s["batch_seqs"], lw=0.8, label="sequences in the batch")
        ax.set(title=f"{name}, {run['rate']:.3g} req/s", xlabel="time (s)", ylabel="sequences")
        kv = ax.twinx()
        kv.plot(s["t_s"], [100 * u for u in s["kv_usage"]], lw=0.8, color="C1", label="KV blocks in use")
        kv.set(ylabel="KV blocks in use (%)", ylim=(0, 105))
        ax.legend(loc="upper left")
        kv.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out / "paper_batch_kv_over_time.png", dpi=DPI)
    plt.close(fig)


def sharing(res: dict[str, Any], out: Path) -> None:
    """Blocks saved by sharing, by kind and width: at the peak and over time (block-steps)."""
    rows = [(k, r) for k, r in res["sharing"].items() if k != "workload"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [100 * r["saved_peak_blocks"] for _, r in rows], 0.4, label="peak blocks")
    ax.bar([x + 0.2 for x in xs], [100 * r["saved_block_steps"] for _, r in rows], 0.4, label="block-steps")
    ax.set_xticks(
        list(xs), [k.replace("parallel_sampling", "n").replace("beam_search", "beam") for k, _ in rows]
    )
    ax.set(ylabel="memory saved by sharing (%)", title="Alpaca shape: sharing against independent sequences")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "paper_sharing.png", dpi=DPI)
    plt.close(fig)


def block_size(res: dict[str, Any], out: Path) -> None:
    """End-to-end normalized latency, and the kernel's time at the largest batch, against block size."""
    panels = [p for p in ("block_sizes", "kernels") if p in res]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "block_sizes":
            ran = res["block_sizes"]
            labels = sorted({label for row in ran.values() for label in row})
            for label in labels:
                sizes = sorted(int(b) for b, row in ran.items() if label in row)
                ys = [1e3 * ran[str(b)][label]["mean_norm_latency_s"] for b in sizes]
                ax.plot(sizes, ys, "o-", label=label)
            ax.set(ylabel="normalized latency (ms/token)", title="end to end")
        else:
            for r in res["kernels"]["rows"]:
                by = r["by_block_size"]
                sizes = [int(b) for b in by if "ms" in by[b]]
                ax.plot(
                    sizes,
                    [1e3 * by[str(b)]["ms"] for b in sizes],
                    "o-",
                    label=f"{r['workload']} x{r['batch']}",
                )
            ax.set(ylabel="decode attention (us)", title="kernel")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="block size (tokens)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "paper_block_size.png", dpi=DPI)
    plt.close(fig)


def kv_waste(res: dict[str, Any], out: Path) -> None:
    """KV waste at the peak of block use, per policy and workload, at the policy's highest sustained rate (its
    lowest rate where it sustains none): slots reserved but not written and slots of partly filled blocks, as
    shares of the slots held, stacked (the paper's Fig. 2); free blocks outside the largest free run (external
    fragmentation), a share of the whole cache, beside them."""
    names = sorted({n for by_name in res["rates"].values() for n in by_name})
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        policies = [p for p, by_name in res["rates"].items() if name in by_name]
        for x, policy in enumerate(policies):
            sweep = res["rates"][policy][name]
            runs = sorted(sweep["runs"], key=lambda r: r["rate"])
            top = sweep["sustained"]["max_rate"]
            run = next((r for r in runs if r["rate"] == top), runs[0])
            w = run["peak_waste"]
            ax.bar(x - 0.2, 100 * w["internal"], 0.4, color="C0", label="internal" if x == 0 else None)
            ax.bar(
                x - 0.2, 100 * w["reserved"], 0.4, bottom=100 * w["internal"], color="C1",
                label="reserved, not written" if x == 0 else None,
            )  # fmt: skip
            ax.bar(
                x + 0.2,
                100 * w["external"],
                0.4,
                color="C2",
                label="external (of the cache)" if x == 0 else None,
            )
            ax.annotate(
                f"{run['rate']:g} req/s", (x, 100 * (w["internal"] + w["reserved"])), ha="center", va="bottom"
            )
        ax.set_xticks(range(len(policies)), policies)
        ax.set(title=f"{name} shape", ylabel="KV slots wasted at the peak (%)", ylim=(0, 105))
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "paper_kv_waste.png", dpi=DPI)
    plt.close(fig)


def kernels(res: dict[str, Any], out: Path) -> None:
    """The paged kernel (block size 16) against SDPA over a contiguous cache, per decode batch."""
    rows = res["kernels"]["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [1e3 * r["ms_paged_16"] for r in rows], 0.4, label="paged, block size 16")
    ax.bar(
        [x + 0.2 for x in xs], [1e3 * r["ms_sdpa_contiguous"] for r in rows], 0.4, label="SDPA, contiguous"
    )
    ax.set_xticks(list(xs), [f"{r['workload']}\nx{r['batch']}" for r in rows])
    ax.set(ylabel="decode attention (us)", title=f"heads {tuple(res['kernels']['heads'])}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "paper_kernels.png", dpi=DPI)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Merge the files given, draw what they hold."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path, nargs="+", help="paper_eval.py JSON files")
    ap.add_argument("--out", type=Path, default=Path("docs/img"))
    args = ap.parse_args(argv)
    res = merge(args.results)
    args.out.mkdir(parents=True, exist_ok=True)
    if any(res["rates"].values()):
        latency_vs_rate(res, args.out)
        kv_waste(res, args.out)
        if res["rates"].get("paged"):
            batch_over_time(res, args.out)
    if "sharing" in res:
        sharing(res, args.out)
    if "block_sizes" in res or "kernels" in res:
        block_size(res, args.out)
    if "kernels" in res:
        kernels(res, args.out)
    print(f"figures in {args.out}")


if __name__ == "__main__":
    main()
