"""The FP8 linear paths at the 8B layers and 1-256 rows, timed as CUDA-graph replays: bf16 (the Triton GEMV at one
row, cuBLASLt above), the Triton FP8 matmul (`kernels/fp8_gemm.py`: its default tiling and the best of a
sweep), `torch._scaled_mm` (row-wise scales) and the per-token quantize launch; first,
the board's bf16 and FP8 matmul rates at 8192^3 (the FP8 roofline's ceiling).

Eager timing (`do_bench`) of kernels of 10-50 us measured the host's launch time here (benchmarks/NOTES.md), so each
figure is the median over 15 replays of a graph of `2 x copies` launches, each launch reading another copy of
the weights (copies enough to exceed the L2 three times). Relative error against the float32 product of the
dequantized operands is printed for the Triton matmul. Sets `GEMM_ROWS` in
`tinypaged/model/quant/fp8.py` and the matmul's `default_config`.

    python3 benchmarks/fp8_gemm_sweep.py --json $OUT/fp8-gemm-sweep.json
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from typing import Any

import torch
import triton
from common import write_json

from tinypaged.kernels.fp8 import quantize_per_token as quantize_launch
from tinypaged.kernels.fp8_gemm import default_config, fp8_gemm
from tinypaged.kernels.gemv import gemv
from tinypaged.model.quant.fp8 import quantize_per_channel, quantize_per_token

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def graph_us(fn: Callable[[int], Any], copies: int) -> float:
    """Median microseconds of one `fn(i)` launch, from replays of a graph of 2 x copies launches."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    calls = 2 * copies
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in range(calls):
            fn(c % copies)
    times = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def tilings(
    m: int, n: int, k: int, block_ks: tuple[int, ...] = (128,)
) -> list[tuple[int, int, int, int, int, int]]:
    """The Triton FP8 matmul's candidate tilings at m rows: 64- and 128-column tiles, K split into 1-8 pieces,
    two pipeline depths; from 128 rows also 128-row tiles (eight warps). `block_ks` other than (128,) (the
    `--block-ks` sweep): each K step's width, with 16 pieces and four stages too."""
    out = []
    block_ms = [min(64, max(16, triton.next_power_of_2(m)))] + ([128] if m >= 128 else [])
    wide = block_ks != (128,)
    pieces_all, stages_all = ((1, 2, 4, 8, 16), (3, 4, 5)) if wide else ((1, 2, 4, 8), (3, 5))
    for bk in block_ks:
        iters = triton.cdiv(k, bk)
        for bm, bn, pieces, stages in itertools.product(block_ms, (64, 128), pieces_all, stages_all):
            if pieces > iters:
                continue
            k_split = 0 if pieces == 1 else triton.cdiv(iters, pieces) * bk
            out.append((bm, bn, bk, 8 if bm == 128 else 4, stages, k_split))
    return out


def sweep(m: int, n: int, k: int, copies: int, xq, xs, ws, block_ks=(128,)) -> tuple[float, tuple, list]:
    rows = []
    for cfg in tilings(m, n, k, block_ks):
        try:
            rows.append((graph_us(lambda i, c=cfg: fp8_gemm(xq, xs, *ws[i], config=c), copies), cfg))
        except Exception:  # a tiling past the shared memory: skipped
            torch.cuda.synchronize()
    best = min(rows)
    return best[0], best[1], rows


def matmul_rates(size: int = 8192) -> dict[str, float]:
    """The board's bf16 and FP8 matmul rates, TFLOP/s, on a size^3 product of random operands (`do_bench` median:
    a launch of about a millisecond, far past its launch time): the ceilings of the FP8 roofline."""
    from triton.testing import do_bench

    a, b = torch.randn(size, size, device="cuda"), torch.randn(size, size, device="cuda")
    aq, sa = quantize_per_token(a)
    bq, sb = quantize_per_channel(b)
    a16, b16 = a.bfloat16(), b.bfloat16()
    flop = 2 * size**3
    bf16_ms = do_bench(lambda: torch.nn.functional.linear(a16, b16), warmup=50, rep=500, return_mode="median")
    fp8_ms = do_bench(
        lambda: torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb.view(1, -1), out_dtype=torch.bfloat16),
        warmup=50,
        rep=500,
        return_mode="median",
    )
    return {"size": size, "bf16_tflops": flop / bf16_ms / 1e9, "fp8_rowwise_tflops": flop / fp8_ms / 1e9}


def measure(
    m: int,
    n: int,
    k: int,
    copies: int,
    ws: list,
    wb: list,
    sweep_too: bool,
    block_ks: tuple[int, ...] = (128,),
) -> dict[str, Any]:
    """Every path's time at m rows of one layer (weights `ws` E4M3 with scales, `wb` bf16, `copies` of each)."""
    dev = ws[0][0].device
    xq, xs = quantize_per_token(torch.randn(m, k, device=dev) * 3)
    xb = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ref = (xq.float() * xs) @ (ws[0][0].float() * ws[0][1][:, None]).T
    got = fp8_gemm(xq, xs, *ws[0])
    err = float((got.float() - ref).norm() / ref.norm())
    # Split-K sums in piece order, never in arrival order: the same launch twice gives the same bits, and a
    # row's sums do not depend on the row count (the first row alone against it within m rows).
    same_twice = bool(torch.equal(got, fp8_gemm(xq, xs, *ws[0])))
    row0 = fp8_gemm(xq[:1].contiguous(), xs[:1].contiguous(), *ws[0])
    r: dict[str, Any] = {"n": n, "k": k, "m": m, "rel_err": err, "deterministic": same_twice}
    r["row0_same_as_alone"] = bool(torch.equal(row0[0], got[0]))
    r["bf16_us"] = graph_us(
        lambda i: gemv(xb, wb[i]) if m == 1 else torch.nn.functional.linear(xb, wb[i]), copies
    )
    r["quantize_us"] = graph_us(lambda i: quantize_launch(xb), copies)
    r["scaled_mm_us"] = graph_us(
        lambda i: torch._scaled_mm(
            xq, ws[i][0].t(), scale_a=xs, scale_b=ws[i][1].view(1, n), out_dtype=torch.bfloat16
        ),
        copies,
    )
    r["fp8_gemm_default"] = default_config(m, n, k)
    r["fp8_gemm_us"] = graph_us(lambda i: fp8_gemm(xq, xs, *ws[i]), copies)
    r["fp8_gemm_tbps"] = n * k / r["fp8_gemm_us"] / 1e6
    if sweep_too:
        r["fp8_gemm_best_us"], r["fp8_gemm_best"], r["sweep"] = sweep(m, n, k, copies, xq, xs, ws, block_ks)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--no-sweep", action="store_true", help="time the default tiling only")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="row counts (default: 1-256)")
    ap.add_argument(
        "--block-ks",
        type=int,
        nargs="+",
        default=[128],
        help="K step widths to sweep (with 16 pieces, 4 stages)",
    )
    args = ap.parse_args()
    dev = torch.device("cuda")
    rates = matmul_rates()
    bf16, fp8 = rates["bf16_tflops"], rates["fp8_rowwise_tflops"]
    print(f"8192^3: bf16 {bf16:.0f} TFLOP/s, FP8 row-wise {fp8:.0f} TFLOP/s", flush=True)
    res: list[dict[str, Any]] = [{"matmul_rates": rates}]
    for name, n, k in SHAPES:
        copies = int(3 * 60e6 // (n * k)) + 1
        ws = [quantize_per_channel(torch.randn(n, k, device=dev) / k**0.5) for _ in range(copies)]
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        for m in args.rows:
            r = {"layer": name, **measure(m, n, k, copies, ws, wb, not args.no_sweep, tuple(args.block_ks))}
            res.append(r)
            write_json(args.json, res)
    print(
        f"{'layer':<8} {'M':>4} {'bf16':>7} {'quant':>6} {'smm':>7} {'gemm':>7} {'TB/s':>5} "
        f"{'best':>7} {'det':>3} {'row0':>4} default / best tiling"
    )
    for r in res[1:]:
        print(
            f"{r['layer']:<8} {r['m']:4d} {r['bf16_us']:7.1f} "
            f"{r['quantize_us']:6.1f} {r['scaled_mm_us']:7.1f} {r['fp8_gemm_us']:7.1f} {r['fp8_gemm_tbps']:5.2f} "
            f"{r.get('fp8_gemm_best_us', float('nan')):7.1f} {r['deterministic']!s:>3.3} "
            f"{r['row0_same_as_alone']!s:>4.4} {r['fp8_gemm_default']} / {r.get('fp8_gemm_best', '')}"
        )


if __name__ == "__main__":
    main()
