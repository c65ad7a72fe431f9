"""float32 linear layers at a few rows on the CPU: what each way of multiplying costs per layer shape of the
default model (SmolLM2-135M), at 1-16 input rows.

Why: a verification of k proposals runs every layer at k + 1 rows, and torch's float32 matmul (MKL) reads the
weight as a matrix-vector product at 1-3 rows but repacks it from 4 rows on, so a verification of 4-7 rows costs
about 1.6 decode steps against 1.1 at 2-3 (benchmarks/NOTES.md, "The CPU's matmuls at a few rows"). Candidates:

- `F.linear`: torch's matmul, the reference every other candidate is checked against;
- `ops.linear`: what the engine runs (the LM head in 512-row slices at 4-12 rows);
- `mm_swapped`: `torch.mm(weight, x.t()).t()`, the same product with the few rows as the matmul's columns;
- `sliced_<s>`: the weight by `s` output rows at a time (each slice's repacking stays in cache);
- `chunks_3`: the input rows 3 at a time (each chunk a matrix-vector product, the weight read once per chunk);
- `onednn`: the weight reordered once by oneDNN (`mkldnn._reorder_linear_weight`), `_linear_pointwise`;
- `mkl_packed`: the weight packed once by MKL for this row count (`mkl._mkl_reorder_linear_weight`), which
  `_mkl_linear` uses only at that row count (other counts fall back to the plain weight), in 3x its bytes.

Each time is the median of `--repeats` passes over 30 distinct copies of the weight (the model has 30 layers of
each; a weight timed over and over sits in cache and reads faster than in a real step), per call, in
microseconds; the LM head (one weight, 113 MB) is timed over 2 copies. Each candidate's result is checked first
against F.linear: its largest error relative to the largest |F.linear| entry.

    python benchmarks/cpu_fewrow_matmul.py --json benchmarks/results/cpu-fewrow-matmul.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from common import write_json

from tinypaged import ops

# The default model's linear layers (out features, in features): hidden 576, 9 query and 3 KV heads of 64,
# MLP 1536 (gate and up fused), 49,152-token tied head.
SHAPES = [
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
]
ROWS = (1, 2, 3, 4, 5, 6, 8, 16)
Matmul = Callable[[torch.Tensor, int], torch.Tensor]  # (x, copy index) -> x @ weight[copy]^T


def sliced(x: torch.Tensor, w: torch.Tensor, size: int) -> torch.Tensor:
    """x @ w^T by `size` output rows at a time, each slice's result written in place."""
    out = x.new_empty(x.shape[0], w.shape[0])
    for ws, o in zip(w.split(size), out.split(size, dim=1), strict=True):
        torch.matmul(x, ws.t(), out=o)
    return out


def candidates(weights: list[torch.Tensor], rows: int) -> dict[str, Matmul]:
    """The ways of multiplying by `weights[i]` at this row count, each with what it prepares once at load."""
    c: dict[str, Matmul] = {
        "F.linear": lambda x, i: F.linear(x, weights[i]),
        "ops.linear": lambda x, i: ops.linear(x, weights[i]),
        "mm_swapped": lambda x, i: torch.mm(weights[i], x.t()).t(),
        "chunks_3": lambda x, i: torch.cat([F.linear(c, weights[i]) for c in x.split(3)]),
    }
    for size in (64, 128, 256, 512):
        if size < weights[0].shape[0]:
            c[f"sliced_{size}"] = lambda x, i, s=size: sliced(x, weights[i], s)
    if torch.backends.mkldnn.is_available():
        reordered = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        c["onednn"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(x, reordered[i], None, "none", [], "")
    if torch.backends.mkl.is_available():
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        c["mkl_packed"] = lambda x, i: torch.ops.mkl._mkl_linear(x, packed[i], weights[i], None, rows)
    return c


def time_us(fn: Matmul, x: torch.Tensor, copies: int, repeats: int) -> float:
    """Median over `repeats` passes of one call per copy, per call in microseconds (after one warm pass)."""
    for i in range(copies):
        fn(x, i)
    passes = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(copies):
            fn(x, i)
        passes.append((time.perf_counter() - t0) / copies * 1e6)
    return statistics.median(passes)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every candidate at every shape and row count: time and relative error against F.linear."""
    torch.manual_seed(0)
    res: dict[str, Any] = {"threads": torch.get_num_threads(), "torch": torch.__version__, "shapes": {}}
    for name, n, k in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        copies = 2 if name == "lm_head" else 30
        weights = [torch.randn(n, k) / k**0.5 for _ in range(copies)]
        shape: dict[str, Any] = {"n": n, "k": k, "copies": copies, "rows": {}}
        for rows in args.rows:
            x = torch.randn(rows, k)
            ref = F.linear(x, weights[0])
            row: dict[str, Any] = {}
            for cand, fn in candidates(weights, rows).items():
                err = ((fn(x, 0) - ref).abs().max() / ref.abs().max()).item()
                row[cand] = {"us": round(time_us(fn, x, copies, args.repeats), 1), "rel_err": err}
            shape["rows"][rows] = row
            best = min(row, key=lambda c: row[c]["us"])
            base = row["F.linear"]["us"]
            print(f"{name:8} {rows:3} rows  F.linear {base:8.1f} us  best {best} {row[best]['us']:.1f}")
        res["shapes"][name] = shape
    return res


def table(res: dict[str, Any]) -> str:
    """One block per shape: a line per candidate, a column per row count (microseconds per call)."""
    lines = []
    for name, shape in res["shapes"].items():
        rows = list(shape["rows"])
        cands = list(shape["rows"][rows[0]])
        lines.append(f"{name} {shape['n']}x{shape['k']} (us per call, median; max rel err)")
        lines.append(f"{'':12}" + "".join(f"{r:>8}" for r in rows) + "   rel err")
        for c in cands:
            times = "".join(f"{shape['rows'][r][c]['us']:8.1f}" for r in rows)
            err = max(shape["rows"][r][c]["rel_err"] for r in rows)
            lines.append(f"{c:12}{times}   {err:.1e}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--shapes", nargs="+", help="only these shapes (qkv, o, gate_up, down, lm_head)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    res = measure(args)
    print(table(res))
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
