"""bf16 linear layers at a few rows on the H200: cuBLASLt (what `ops.linear` takes from two rows), the Triton GEMV
(one row) and `skinny_matmul` (the FP8 matmul's kernel unscaled: weight rows on the tensor cores' 64-row side,
the few token rows on the other, K split by the layer's shape), at the 8B layers and the LM head.

A verification step of speculative decoding (k = 4: 5 rows, padded to the 16-token mixed graph) runs every
layer at 16 rows: cuBLASLt there took 4.2 ms of the step's matmuls against the one-row GEMV's 3.9 (run 93).
Each figure is the median of 15 replays of a CUDA graph of `2 x copies` launches, each launch reading another
copy of the weights (copies enough to pass 180 MB, past the L2 several times): eager timing of kernels of 10-60
us measures the host's launch (NOTES.md). Each skinny result is checked first: relative error against the
float32 product, the same bits twice, and the first row alone the same bits as within the batch.

    python3 benchmarks/skinny_matmul.py --json $OUT/skinny-matmul.json [--no-sweep]

The sweep (at 1, 5 and 16 rows) times 64- and 128-column tiles, K in 1-16 pieces and 3-5 pipeline stages; the
table prints the default's time, the sweep's best and its tiling: the defaults follow the sweep.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
import triton
from common import write_json
from fp8_gemm_sweep import graph_us  # CUDA-graph replays of each launch

from tinypaged import ops
from tinypaged.kernels.fp8_gemm import skinny_config, skinny_matmul
from tinypaged.kernels.gemv import gemv

SHAPES = [
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
    ("lm_head", 128256, 4096),
]
ROWS = (1, 2, 4, 5, 8, 16, 32)
SWEEP_ROWS = (1, 5, 16)


def tilings(m: int, k: int, block_ks: tuple[int, ...] = (128,)) -> list[tuple[int, int, int, int, int, int]]:
    """Candidate tilings at m rows (up to 32): 64- and 128-column tiles, K in 1-16 pieces of `block_ks`-wide
    steps, 3-5 stages."""
    block_m = max(16, triton.next_power_of_2(m))
    out = []
    for bk, bn, pieces, stages in itertools.product(block_ks, (64, 128), (1, 2, 4, 8, 16), (3, 4, 5)):
        iters = triton.cdiv(k, bk)
        if pieces > iters:
            continue
        k_split = 0 if pieces == 1 else triton.cdiv(iters, pieces) * bk
        out.append((block_m, bn, bk, 4, stages, k_split))
    return out


def measure(
    m: int, n: int, k: int, ws: list[torch.Tensor], sweep: bool, block_ks: tuple[int, ...] = (128,)
) -> dict[str, Any]:
    """Every path's time at m rows of one layer (`ws`: copies of its bf16 weight)."""
    copies = len(ws)
    x = torch.randn(m, k, device=ws[0].device, dtype=torch.bfloat16)
    ref = x.float() @ ws[0].float().T
    got = skinny_matmul(x, ws[0])
    r: dict[str, Any] = {"n": n, "k": k, "m": m}
    r["rel_err"] = float((got.float() - ref).norm() / ref.norm())
    r["cublas_rel_err"] = float((torch.nn.functional.linear(x, ws[0]).float() - ref).norm() / ref.norm())
    r["deterministic"] = bool(torch.equal(got, skinny_matmul(x, ws[0])))
    r["row0_same_as_alone"] = bool(torch.equal(skinny_matmul(x[:1].contiguous(), ws[0])[0], got[0]))
    r["cublaslt_us"] = graph_us(lambda i: torch.nn.functional.linear(x, ws[i]), copies)
    if m == 1:
        r["gemv_us"] = graph_us(lambda i: gemv(x, ws[i]), copies)
    r["default"] = skinny_config(m, n, k)
    r["skinny_us"] = graph_us(lambda i: skinny_matmul(x, ws[i]), copies)
    r["skinny_tbps"] = 2 * n * k / r["skinny_us"] / 1e6
    if sweep:
        rows = []
        for cfg in tilings(m, k, block_ks):
            try:
                rows.append((graph_us(lambda i, c=cfg: skinny_matmul(x, ws[i], config=c), copies), cfg))
            except Exception:  # noqa: BLE001 - a tiling past the shared memory: skipped
                torch.cuda.synchronize()
        best = min(rows)
        r["best_us"], r["best"] = best
        r["sweep"] = [[t, list(c)] for t, c in rows]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--no-sweep", action="store_true", help="the default tilings only")
    ap.add_argument("--block-ks", type=int, nargs="+", default=[128], help="K step widths to sweep")
    ap.add_argument("--sweep-rows", type=int, nargs="+", default=list(SWEEP_ROWS))
    args = ap.parse_args()
    ops.prefer_cublaslt()  # as the engine runs
    dev = torch.device("cuda")
    res: list[dict[str, Any]] = []
    for name, n, k in SHAPES:
        copies = int(180e6 // (2 * n * k)) + 1
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        for m in ROWS:
            sweep = not args.no_sweep and m in args.sweep_rows
            r = {"layer": name, **measure(m, n, k, ws, sweep, tuple(args.block_ks))}
            res.append(r)
            write_json(args.json, res)
            print(
                f"{name} m={m}: cuBLASLt {r['cublaslt_us']:.1f} us, skinny {r['skinny_us']:.1f}"
                f" (best {r.get('best_us', float('nan')):.1f} {r.get('best', '')})",
                flush=True,
            )
        del ws
        torch.cuda.empty_cache()
    print(
        f"{'layer':<8} {'M':>3} {'cuBLASLt':>8} {'GEMV':>6} {'skinny':>7} {'TB/s':>5} {'best':>7} {'err':>8}"
        f" {'det':>4} {'row0':>4} default / best tiling"
    )
    for r in res:
        print(
            f"{r['layer']:<8} {r['m']:3d} {r['cublaslt_us']:8.1f} {r.get('gemv_us', float('nan')):6.1f}"
            f" {r['skinny_us']:7.1f} {r['skinny_tbps']:5.2f} {r.get('best_us', float('nan')):7.1f}"
            f" {r['rel_err']:8.1e} {r['deterministic']!s:>4.4} {r['row0_same_as_alone']!s:>4.4}"
            f" {r['default']} / {r.get('best', '')}"
        )


if __name__ == "__main__":
    main()
