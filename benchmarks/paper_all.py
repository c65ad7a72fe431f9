"""The paper's whole evaluation again, on an H200, in one command (issue 40; docs/paper.md holds the verdicts):

    python benchmarks/paper_all.py                 # every step, then the figures into docs/img
    python benchmarks/paper_all.py --dry-run       # the commands only
    python benchmarks/paper_all.py --steps kernels-13b block-sizes-13b

Each step is one `paper_eval.py` process, sized to stay under 10 minutes on an H200 (the runs 69-86 that the
docs quote ran these commands, one device call each); the last draws the figures from the files the steps
wrote (`paper_plots.py`). The random-weight models are written when missing: the 13B multi-head shape (the
paper's OPT-13B pressure: KV capped at 15,000 tokens, about what its A100-40GB left) by the first 13B step,
the 8B shape (sharing) by `tinypaged weights random`. About 45 minutes in all. A step that fails is reported
and the others still run; the command exits non-zero if any failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KV_13B = ["--kv-tokens", "15000"]
# The ShareGPT shape's bound: twice paged's normalized latency at 1.1 req/s on the 13B shape (run 76).
SHAREGPT_BOUND = ["--latency-bound", "0.0171"]
ONE_RATE_EACH = ["--skip-saturated", "--stop-over-bound"]


def steps(m8: str, m13: str, results: Path, tag: str) -> dict[str, list[str]]:
    """Each step's `paper_eval.py` arguments (the sharing step's model made first, by `prepare`)."""

    def out(name: str) -> list[str]:
        return ["--json", str(results / f"paper-{name}{tag}.json")]

    l13 = ["--model", m13, "--random-shape", "llama-13b-mha", *KV_13B]
    sharegpt = [
        *l13,
        "--sections",
        "rates",
        "--workloads",
        "sharegpt",
        *SHAREGPT_BOUND,
        "--num-requests",
        "120",
    ]
    alpaca = [
        *l13,
        "--sections",
        "rates",
        "--workloads",
        "alpaca",
        "--num-requests",
        "600",
        "--max-num-seqs",
        "512",
    ]
    return {
        # every policy at the same rates under paged's bound (run 77), then between them (run 78)
        "sharegpt-13b": [
            *sharegpt, "--policies", "paged", "orca-oracle", "orca-pow2", "orca-max",
            "--sharegpt-rates", "3", "6", "9", "12", "--same-rates", *ONE_RATE_EACH,
            *out("rates-sharegpt-13b"),
        ],
        "sharegpt-13b-orca-between": [
            *sharegpt, "--policies", "orca-oracle", "orca-pow2", "--sharegpt-rates", "4", "5", *ONE_RATE_EACH,
            *out("rates-sharegpt-13b-orca-between"),
        ],
        "sharegpt-13b-paged-between": [
            *sharegpt, "--policies", "paged", "--sharegpt-rates", "10.5", *ONE_RATE_EACH,
            *out("rates-sharegpt-13b-paged-between"),
        ],
        # paged until over its bound, then the Orca policies at its rates (run 79)
        "alpaca-13b-paged": [
            *alpaca, "--policies", "paged",
            "--alpaca-rates", "20", "40", "60", "80", "100", "120", "150", "180", "210", "250", *ONE_RATE_EACH,
            *out("rates-alpaca-13b-paged"),
        ],
        "alpaca-13b-orca": [
            *alpaca, "--policies", "orca-oracle", "orca-pow2", "orca-max",
            "--rates-from", str(results / f"paper-rates-alpaca-13b-paged{tag}.json"), *ONE_RATE_EACH,
            *out("rates-alpaca-13b-orca"),
        ],
        "sharing-8b": ["--model", m8, "--sections", "sharing", *out("sharing")],
        "kernels-13b": [*l13, "--sections", "kernels", *out("kernels-13b")],
        # block sizes end to end, spread out first so that a step cut short keeps the range (runs 85, 86)
        "block-sizes-13b": [
            *l13, "--sections", "block_sizes", "--block-sizes", "16", "1", "128", "4", "64", "8", "32", "2",
            "--sharegpt-block-rate", "6", "--alpaca-block-rate", "80", "--sharegpt-block-requests", "90",
            "--alpaca-block-requests", "400", "--max-num-seqs", "512", *out("block-sizes-13b"),
        ],
        "block-sizes-13b-sharegpt10": [
            *l13, "--sections", "block_sizes", "--workloads", "sharegpt", "--block-sizes", "16", "128", "1", "64",
            "--sharegpt-block-rate", "10", "--sharegpt-block-requests", "150", "--max-num-seqs", "512",
            *out("block-sizes-13b-sharegpt10"),
        ],
    }  # fmt: skip


def json_of(argv: list[str]) -> str:
    return argv[argv.index("--json") + 1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-8b", default="/tmp/m8b", help="the 8B shape (written when missing)")
    ap.add_argument(
        "--model-13b", default="/tmp/l13b", help="the 13B multi-head shape (written when missing)"
    )
    ap.add_argument("--results", type=Path, default=HERE / "results")
    ap.add_argument("--img", type=Path, default=HERE.parent / "docs" / "img")
    ap.add_argument("--tag", default="h200", help="file names end -TAG.json")
    ap.add_argument("--steps", nargs="+", help="only these (default: all, in order)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    plan = steps(args.model_8b, args.model_13b, args.results, f"-{args.tag}" if args.tag else "")
    unknown = set(args.steps or ()) - set(plan)
    if unknown:
        ap.error(f"unknown steps {sorted(unknown)}; steps: {', '.join(plan)}")
    chosen = [name for name in plan if not args.steps or name in args.steps]
    commands: list[tuple[str, list[str]]] = []
    if "sharing-8b" in chosen and not (Path(args.model_8b) / "config.json").exists():
        commands.append(
            (
                "model-8b",
                ["tinypaged", "weights", "random", "--config", "llama-3.1-8b", "--out", args.model_8b],
            )
        )
    commands += [(name, [sys.executable, str(HERE / "paper_eval.py"), *plan[name]]) for name in chosen]
    files = [json_of(plan[name]) for name in plan]
    commands.append(("plots", [sys.executable, str(HERE / "paper_plots.py"), *files, "--out", str(args.img)]))
    failed = []
    for name, cmd in commands:
        print(f"=== {name}: {' '.join(cmd)}", flush=True)
        if args.dry_run:
            continue
        if name == "plots":
            cmd = [*cmd[:2], *(f for f in cmd[2:-2] if Path(f).exists()), *cmd[-2:]]
        t0 = time.monotonic()
        rc = subprocess.run(cmd, check=False).returncode
        print(f"=== {name}: exit {rc}, {time.monotonic() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
