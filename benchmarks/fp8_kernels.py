"""Check the FP8 (W8A8) kernels on the GPU at the 8B shape, and time the fused activation producers.

    python3 benchmarks/fp8_kernels.py --json $OUT/fp8-kernels.json [--producers-only]

First, correctness on the GPU: the quantizers (plain, fused into RMSNorm and SwiGLU, the SwiGLU at few rows in
tiles and at many one program a row) bit for bit against `fp8.quantize_per_token`, and the Triton FP8 matmul,
`_scaled_mm` and `fp8.fp8_linear` against `ref_fp8_linear` at each of Llama-3.1-8B's layers (qkv 6144x4096,
o 4096x4096, gate_up 28672x4096, down 4096x14336; weight [N, K]) and 1-512 rows (relative error; FP8's own error
against the bf16 product recorded for scale). Then the fused RMSNorm and SwiGLU against their plain kernels as
CUDA-graph replays. The products' times are `benchmarks/fp8_gemm_sweep.py`'s. Prints a table last; writes JSON.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

import torch
import triton
from common import write_json

import tinypaged.kernels as tk
from tinypaged import ops
from tinypaged.kernels.fp8_gemm import fp8_gemm
from tinypaged.model.quant import fp8
from tinypaged.quantization import Fp8Scheme

ROOT = Path(__file__).resolve().parents[1]
DEV = "cuda"
DT = torch.bfloat16
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
RESULTS: dict[str, Any] = {"checks": [], "producers": []}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check(name: str, err: float, tol: float) -> None:
    """Record (and print) one correctness check (err 0: bit for bit)."""
    ok = err <= tol and not math.isnan(err)
    RESULTS["checks"].append({"name": name, "rel_err": err, "tol": tol, "ok": ok})
    print(f"check {name:58s} err {err:.2e} (tol {tol:.0e}) {'ok' if ok else 'FAIL'}", flush=True)


def same_fp8(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> float:
    """0.0 when the E4M3 bytes and scales are equal, else the fraction of codes that differ (1.0: scales)."""
    if not torch.equal(got[1], want[1]):
        return 1.0
    return (got[0].view(torch.uint8) != want[0].view(torch.uint8)).float().mean().item()


def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random bf16 weight [n, k] and its E4M3 form with per-row scales."""
    w = torch.randn(n, k, device=DEV, dtype=DT) / k**0.5
    q, scale = fp8.quantize_per_channel(w)
    return w, q, scale


def correctness() -> None:
    """The quantizers bit for bit, the products against the float32 reference, at the 8B shapes."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    for k in (4096, 14336, 20000):  # the one-tile rows, and past 16,384 (two passes)
        x = torch.randn(37, k, device=DEV, dtype=DT, generator=gen) * 3
        check(
            f"quantize [37, {k}] vs quantize_per_token",
            same_fp8(tk.quantize_fp8(x), fp8.quantize_per_token(x)),
            0,
        )
        scale = torch.tensor([0.01], device=DEV)
        want = (fp8.quantize(x, scale), scale.expand(37, 1))
        check(f"quantize [37, {k}] static vs quantize", same_fp8(tk.quantize_fp8(x, scale), want), 0)
        gate_up = torch.randn(37, 2 * k, device=DEV, dtype=DT, generator=gen) * 3
        want = fp8.quantize_per_token(tk.silu_and_mul(gate_up))
        check(f"silu_and_mul_fp8 [37, {k}] vs plain", same_fp8(tk.silu_and_mul_fp8(gate_up), want), 0)
        one_tile = k <= 16384
        got = tk.silu_and_mul_fp8(gate_up, (one_tile, 16384 if one_tile else 4096, 16))
        check(f"silu_and_mul_fp8 [37, {k}] a program a row vs plain", same_fp8(got, want), 0)
    x, res = (torch.randn(37, 4096, device=DEV, dtype=DT, generator=gen) for _ in range(2))
    w = torch.randn(4096, device=DEV, dtype=DT, generator=gen)
    q, scale, res_sum = tk.rms_norm_fp8(x, w, 1e-5, res)
    out, res_plain = tk.rms_norm(x, w, 1e-5, res)
    check("rms_norm_fp8 [37, 4096] vs plain", same_fp8((q, scale), fp8.quantize_per_token(out)), 0)
    check("rms_norm_fp8 residual sum vs plain", float(not torch.equal(res_sum, res_plain)), 0)
    for name, n, k in SHAPES:
        w, wq, ws = weight(n, k)
        for m in (1, 3, 8, 64, 200, 512):
            check_products(name, m, w, wq, ws, gen)


def check_products(
    name: str, m: int, w: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, gen: torch.Generator
) -> None:
    """The Triton FP8 matmul, _scaled_mm and `fp8_linear` at m rows against `ref_fp8_linear`, and FP8's own error
    against the bf16 product (recorded, not judged)."""
    n, k = w.shape
    x = torch.randn(m, k, device=DEV, dtype=DT, generator=gen)
    xa = fp8.Fp8Activation(*tk.quantize_fp8(x), DT)
    want = (
        fp8.dequantize(xa.q, xa.scale) @ fp8.dequantize_weight(wq, ws).T
    )  # ref_fp8_linear before its rounding
    y = fp8_gemm(xa.q, xa.scale, wq, ws, None, DT)
    check(f"fp8_gemm {name} m={m} vs ref", rel_err(y, want), 1e-2)
    y = torch._scaled_mm(xa.q, wq.t(), scale_a=xa.scale, scale_b=ws.view(1, n), out_dtype=DT)
    check(f"_scaled_mm {name} m={m} vs ref", rel_err(y, want), 1e-2)
    y = fp8.fp8_linear(x, wq, ws, None, Fp8Scheme("channel", "token"))
    check(f"fp8_linear {name} m={m} vs ref", rel_err(y, want), 1e-2)
    bf16 = torch.nn.functional.linear(x.float(), w.float())
    RESULTS["checks"].append({"name": f"fp8 vs bf16 {name} m={m}", "rel_err": rel_err(want, bf16)})


def producers() -> None:
    """The fused producers against their plain kernels at 1-256 rows, timed as CUDA-graph replays over input
    copies past the L2 (graph_us): the RMSNorm with the residual add (hidden 4096), the SwiGLU (inner 14336,
    whose FP8 variant runs one program a row) against the plain SwiGLU with and without a quantize launch after
    it, and the quantize launch alone on o_proj's input (4096)."""
    for m in (1, 8, 64, 128, 256):
        RESULTS["producers"].append(producers_row(m))


def producers_row(m: int) -> dict[str, Any]:
    """The producers' times at m rows, us."""
    from fp8_gemm_sweep import graph_us

    copies = max(2, int(3 * 60e6 // (m * 2 * 14336 * 2)) + 1)
    xs = [torch.randn(m, 4096, device=DEV, dtype=DT) for _ in range(copies)]
    res = [torch.randn(m, 4096, device=DEV, dtype=DT) for _ in range(copies)]
    w = torch.randn(4096, device=DEV, dtype=DT)
    gate_up = [torch.randn(m, 2 * 14336, device=DEV, dtype=DT) for _ in range(copies)]
    row = {
        "m": m,
        "rms_norm": graph_us(lambda i: tk.rms_norm(xs[i], w, 1e-5, res[i]), copies),
        "rms_norm_fp8": graph_us(lambda i: tk.rms_norm_fp8(xs[i], w, 1e-5, res[i]), copies),
        "silu_and_mul": graph_us(lambda i: tk.silu_and_mul(gate_up[i]), copies),
        "silu_and_mul_fp8": graph_us(lambda i: tk.silu_and_mul_fp8(gate_up[i]), copies),
        "silu_and_mul+quantize": graph_us(lambda i: tk.quantize_fp8(tk.silu_and_mul(gate_up[i])), copies),
        # The fused SwiGLU's other launch shapes: the row in one tile with 8 or 32 warps, or walked twice.
        **{
            f"silu_and_mul_fp8 {cfg}": graph_us(lambda i, c=cfg: tk.silu_and_mul_fp8(gate_up[i], c), copies)
            for cfg in [(True, 16384, 8), (True, 16384, 32), (False, 4096, 8), (False, 2048, 4)]
        },
        "quantize_4096": graph_us(lambda i: tk.quantize_fp8(xs[i]), copies),
    }
    print(f"producers m={m}: " + ", ".join(f"{k} {v:.1f} us" for k, v in row.items() if k != "m"), flush=True)
    return row


def markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines, after a blank one."""
    return ["", "| " + " | ".join(header) + " |", "|---" * len(header) + "|"] + [
        "| " + " | ".join(row) + " |" for row in rows
    ]


def us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def table() -> str:
    """The summary: checks, then the producers' times."""
    checks = [c for c in RESULTS["checks"] if "ok" in c]
    lines = [
        f"device: {RESULTS['device']}; torch {torch.__version__}, triton {triton.__version__}",
        f"checks: {sum(c['ok'] for c in checks)}/{len(checks)} ok; failed: "
        + (", ".join(c["name"] for c in checks if not c["ok"]) or "none"),
        "fp8 vs bf16 rel err: "
        + ", ".join(f"{c['name'][12:]} {c['rel_err']:.3f}" for c in RESULTS["checks"] if "ok" not in c),
    ]
    keys = [
        "rms_norm",
        "rms_norm_fp8",
        "silu_and_mul",
        "silu_and_mul_fp8",
        "silu_and_mul+quantize",
        "quantize_4096",
    ]
    lines += markdown(
        [
            "producers, us",
            "M",
            "RMSNorm",
            "RMSNorm FP8",
            "SwiGLU",
            "SwiGLU FP8",
            "SwiGLU, quantize",
            "quantize 4096",
        ],
        [["", str(r["m"])] + [f"{r[k]:.1f}" for k in keys] for r in RESULTS["producers"]],
    )
    return "\n".join(lines)


def main() -> None:
    """Check, time, sweep; then print the table and write the JSON."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    out = Path(os.environ.get("OUT", ROOT / "benchmarks" / "out")) / "fp8-kernels.json"
    parser.add_argument("--json", default=str(out), help="where to write the results")
    parser.add_argument("--producers-only", action="store_true", help="time the fused producers only")
    args = parser.parse_args()
    torch.manual_seed(0)
    ops.prefer_cublaslt()  # as the model runner does
    RESULTS["device"] = torch.cuda.get_device_name()
    if args.producers_only:
        producers()
        write_json(args.json, RESULTS)
        return
    correctness()
    producers()
    text = table()
    RESULTS["table"] = text
    write_json(args.json, RESULTS)
    print("\n" + text)


if __name__ == "__main__":
    main()
