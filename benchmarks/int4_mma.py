"""INT4 weight-only matmuls of 1-16 rows through the Gluon kernel that loads the weights straight into the tensor
cores' registers (`kernels/lowbit_mma.py`), against the Triton tensor-core kernel (`kernels/lowbit.py`
`wint_gemm`) and bf16, on the GPU (issue 38).

    python3 benchmarks/int4_mma.py --json benchmarks/results/int4-mma-h200.json [--no-sweep]

First the checks: at Llama-3.1-8B's four layer shapes and two odd ones, bf16 and fp16 rows (1, 2, 5, 8, 9, 16),
with and without zero points, one with a bias, the words straight into registers and through the shared ring
(equal bits both ways): the relative error against the float32 product of the same codes (`ref`: x in float32 @
the dequantized weight), beside `wint_gemm`'s; the same bits twice; a row alone against the same row within a
batch of 16. Then the layers timed as CUDA-graph replays, each launch on its own copy of the weight (past the L2),
at 1, 2, 4, 8 and 16 rows: bf16 `ops.linear`, `wint_gemm` and `int4_mma` at its default and with a ring of `RING`
steps, with the weight bytes each reads per second; then a sweep of `int4_mma`'s tilings (warps, 16-row tiles a
warp, K split, the words' ring depth: 0 straight into registers, else cp.async through shared memory) at 1 and 8
rows. The table is printed last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from typing import Any

import torch
from common import write_json
from fp8_gemm_sweep import graph_us

from tinypaged import ops
from tinypaged.kernels import lowbit as kernels
from tinypaged.kernels import lowbit_mma
from tinypaged.model.quant import lowbit

DEV = "cuda"
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
ODD = [("odd-a", 200, 384), ("odd-b", 1000, 1152)]
# Ring depths checked and swept: 0 (the words straight into registers) and the shared ring's.
RING = 4
STAGES = (0, RING)
SWEPT_STAGES = (0, 3, 4, 6)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def nbytes(w: lowbit.IntWeight) -> int:
    return sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.zeros) if t is not None)


def checks(res: dict[str, Any], gen: torch.Generator, quick: bool) -> None:
    out = res.setdefault("checks", [])
    rows = (1, 5, 16) if quick else (1, 2, 5, 8, 9, 16)
    for (name, n, k), sym in itertools.product(SHAPES + ODD, (False, True)):
        if quick and sym and name not in ("o", "odd-b"):
            continue
        w32 = torch.randn(n, k, device=DEV, generator=gen) / k**0.5
        w = lowbit.quantize_rtn(w32, 4, 128, sym)
        ref_w = lowbit.dequantize_weight(w)
        bias = torch.randn(n, device=DEV, dtype=torch.bfloat16, generator=gen) if name == "odd-b" else None
        for dt, m in itertools.product((torch.bfloat16, torch.float16), rows):
            x = torch.randn(m, k, device=DEV, dtype=dt, generator=gen)
            want = x.float() @ ref_w.T + (0 if bias is None else bias.float())
            triton_err = rel_err(kernels.wint_gemm(x, w, bias), want)
            first = None
            for stages in STAGES:  # the words straight into registers, and through the shared ring
                cfg = lowbit_mma.mma_config(m, n, k)[:3] + (stages,)
                got = lowbit_mma.int4_mma(x, w, bias, cfg)
                again = lowbit_mma.int4_mma(x, w, bias, cfg)
                row = {
                    "name": f"{name} {'sym' if sym else 'zp'} {str(dt)[6:]} M={m} stages={stages}",
                    "err": rel_err(got, want),
                    "triton_err": triton_err,
                    "same_twice": bool(torch.equal(got, again)),
                }
                if m == 16:
                    alone = torch.cat([lowbit_mma.int4_mma(x[i : i + 1], w, bias, cfg) for i in range(m)])
                    row["row_alone_equal"] = bool(torch.equal(alone, got))
                if first is None:
                    first = got
                else:  # the same sums in the same order, whichever way the words came in
                    row["equal_to_registers"] = bool(torch.equal(got, first))
                ok = (
                    row["same_twice"]
                    and row.get("row_alone_equal", True)
                    and row.get("equal_to_registers", True)
                )
                row["ok"] = row["err"] < 5e-3 and ok
                out.append(row)
                if not row["ok"]:
                    print("CHECK FAILED", row, flush=True)
        del w32, w, ref_w
    bad = [c for c in out if not c["ok"]]
    print(
        f"checks: {len(out) - len(bad)} of {len(out)} pass; worst err {max(c['err'] for c in out):.2e}",
        flush=True,
    )


def copies_for(n: int, past: float = 256e6) -> int:
    return max(2, math.ceil(past / n))


def timings(res: dict[str, Any], gen: torch.Generator, sweep: bool, path: str) -> None:
    rows_out, sweep_out = res.setdefault("layers", []), res.setdefault("sweep", [])
    for name, n, k in SHAPES:
        wb = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=gen) / k**0.5
        w = lowbit.quantize_rtn(wb, 4, 128, False)
        ws = [w] + [w._replace(qweight=w.qweight.clone(), scales=w.scales.clone(), zeros=w.zeros.clone())
                    for _ in range(copies_for(nbytes(w)) - 1)]  # fmt: skip
        bs = [wb] + [wb.clone() for _ in range(copies_for(2 * n * k) - 1)]
        for m in (1, 2, 4, 8, 16):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
            row: dict[str, Any] = {"layer": name, "n": n, "k": k, "m": m}
            row["bf16_us"] = graph_us(lambda i, x=x, bs=bs: ops.linear(x, bs[i]), len(bs))
            row["triton_us"] = graph_us(lambda i, x=x, ws=ws: kernels.wint_gemm(x, ws[i]), len(ws))
            row["mma_us"] = graph_us(lambda i, x=x, ws=ws: lowbit_mma.int4_mma(x, ws[i]), len(ws))
            row["mma_config"] = lowbit_mma.mma_config(m, n, k)
            ring = row["mma_config"][:3] + (RING,)
            row["ring_us"] = graph_us(
                lambda i, x=x, c=ring, ws=ws: lowbit_mma.int4_mma(x, ws[i], config=c), len(ws)
            )
            row["mma_tbps"] = nbytes(w) / row["mma_us"] / 1e6
            row["ring_tbps"] = nbytes(w) / row["ring_us"] / 1e6
            row["triton_tbps"] = nbytes(w) / row["triton_us"] / 1e6
            rows_out.append(row)
            print(row, flush=True)
            if not sweep or m not in (1, 8):
                continue
            steps = k // 128
            rule = lowbit_mma.mma_config(m, n, k)[2]
            tilings = itertools.product(((4, 1), (8, 1), (4, 2), (2, 2), (4, 4)), SWEPT_STAGES)
            for (warps, reps), stages in tilings:
                for split in (rule // 2, rule, rule * 2, rule * 4):
                    if split < 1 or steps % split or steps // split < 2:
                        continue
                    cfg = (16 * warps * reps, warps, split, stages)
                    try:
                        us = graph_us(
                            lambda i, x=x, c=cfg, ws=ws: lowbit_mma.int4_mma(x, ws[i], config=c), len(ws)
                        )
                    except Exception as e:  # noqa: BLE001 - a tiling that does not compile or fit
                        print(name, m, cfg, type(e).__name__, str(e)[:200], flush=True)
                        us = float("nan")
                    sweep_out.append({"layer": name, "m": m, "config": cfg, "us": us})
            done = [s for s in sweep_out if s["layer"] == name and s["m"] == m and s["us"] == s["us"]]
            if done:
                best = min(done, key=lambda s: s["us"])
                print(f"  best {name} M={m}: {best['config']} {best['us']:.1f} us", flush=True)
        del ws, bs
        torch.cuda.empty_cache()
        write_json(path, res)  # a layer at a time: a cut run keeps what it measured


def best_configs(res: dict[str, Any]) -> dict[tuple[int, int, int], tuple]:
    """The sweep's fastest tiling by (N, K, M) at the rows it swept."""
    best: dict[tuple[int, int, int], tuple[float, tuple]] = {}
    for srow in res.get("sweep", []):
        n, k = next((n, k) for name, n, k in SHAPES if name == srow["layer"])
        key = (n, k, srow["m"])
        if srow["us"] == srow["us"] and (key not in best or srow["us"] < best[key][0]):
            best[key] = (srow["us"], tuple(srow["config"]))
    return {key: cfg for key, (_, cfg) in best.items()}


def decode(res: dict[str, Any], model: str) -> None:
    """Batch-1 and batch-16 decode (benchmarks/lowbit.py's measurements) of bf16, INT4 through the Triton kernel
    (`TINYPAGED_INT4_MMA=0`), INT4 through `int4_mma` at its default tilings with the words straight into
    registers and through a ring of `RING` steps in shared memory and, where the sweep ran, at the sweep's fastest
    (M = 1's at one row, M = 8's at 2-8), one engine after the other in this process."""
    import os

    from common import free_llm, run_latency
    from lowbit import run_batch

    from tinypaged import LLM

    out = res.setdefault("decode", {})
    table = best_configs(res)
    default = lowbit_mma.mma_config
    stages = lowbit_mma.MMA_STAGES
    int4 = {"quantization": "int4"}
    variants = [("bf16", {}, None, None, stages), ("int4-triton", int4, "0", None, stages),
                ("int4-mma", int4, "1", None, 0), ("int4-mma-ring", int4, "1", None, RING)]  # fmt: skip
    if table:  # each shape's fastest tiling, its ring depth included
        variants.append(("int4-mma-swept", int4, "1", table, stages))
    for name, kw, env, tab, ring in variants:
        os.environ["TINYPAGED_INT4_MMA"] = env or "1"
        lowbit_mma._runs_on.cache_clear()  # the switch is read once a process: again for this engine
        lowbit_mma.MMA_STAGES = ring  # mma_config's ring depth (0: the words straight into registers)
        if tab:
            lowbit_mma.mma_config = lambda m, n, k, sms=132, t=tab: (
                t.get((n, k, 1 if m == 1 else 8)) or default(m, n, k, sms)
            )
        try:
            llm = LLM(model=model, max_model_len=2048, max_num_seqs=64, **kw)
            lat = run_latency(llm, modes=("graphs",))
            b16 = run_batch(llm)
            b16.pop("tokens", None)
            out[name] = {"batch1": lat.get("graphs", {}), "batch16": b16}
            free_llm(llm)
        finally:
            lowbit_mma.mma_config = default
            lowbit_mma.MMA_STAGES = stages
            os.environ.pop("TINYPAGED_INT4_MMA", None)
        b1 = out[name]["batch1"].get("decode_tokens_per_s", float("nan"))
        print(f"decode {name}: batch-1 {b1:.1f} tok/s, batch-16 {b16['decode_tokens_per_s']:.1f}", flush=True)


def table(res: dict[str, Any]) -> None:
    print(
        f"\n{'layer':8} {'M':>3} {'bf16 us':>8} {'triton us':>9} {'ring us':>7} {'mma us':>7} {'mma TB/s':>8} "
        f"{'best us':>8}  best"
    )
    for r in res.get("layers", []):
        cands = [
            s
            for s in res.get("sweep", [])
            if s["layer"] == r["layer"] and s["m"] == r["m"] and s["us"] == s["us"]
        ]
        best = min(cands, key=lambda s: s["us"]) if cands else None
        print(
            f"{r['layer']:8} {r['m']:>3} {r['bf16_us']:8.1f} {r['triton_us']:9.1f} {r.get('ring_us', math.nan):7.1f} "
            f"{r['mma_us']:7.1f} "
            f"{r['mma_tbps']:8.2f} {best['us'] if best else float('nan'):8.1f}  {best['config'] if best else ''}"
        )
    tot = {m: [sum(r[c] for r in res.get("layers", []) if r["m"] == m) for c in ("bf16_us", "triton_us", "mma_us")]
           for m in sorted({r["m"] for r in res.get("layers", [])})}  # fmt: skip
    for m, (b, t, q) in tot.items():
        print(
            f"a layer's four matmuls at M={m}: bf16 {b:.1f} us, triton {t:.1f}, mma {q:.1f} ({t / q:.2f}x triton)"
        )
    dec = res.get("decode", {})
    if dec:
        base = dec.get("bf16", {})
        print(f"\n{'engine':15} {'b1 tok/s':>9} {'x bf16':>7} {'b16 tok/s':>10} {'x bf16':>7}")
        for name, r in dec.items():
            b1, b16 = (
                r["batch1"].get("decode_tokens_per_s", float("nan")),
                r["batch16"]["decode_tokens_per_s"],
            )
            x1 = b1 / base["batch1"]["decode_tokens_per_s"] if base else float("nan")
            x16 = b16 / base["batch16"]["decode_tokens_per_s"] if base else float("nan")
            print(f"{name:15} {b1:9.1f} {x1:7.3f} {b16:10.1f} {x16:7.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--quick-checks", action="store_true", help="fewer shapes and row counts")
    ap.add_argument("--skip-layers", action="store_true")
    ap.add_argument("--decode", metavar="MODEL", help="also the engines' decode on this checkpoint")
    ap.add_argument(
        "--resume", action="store_true", help="start from --json's results (a sweep for --decode)"
    )
    args = ap.parse_args()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.resume:
        with open(args.json) as f:
            res = json.load(f)
    gen = torch.Generator(device=DEV).manual_seed(0)
    if not args.skip_checks:
        checks(res, gen, args.quick_checks)
        write_json(args.json, res)
    if not args.skip_layers:
        timings(res, gen, not args.no_sweep, args.json)
        write_json(args.json, res)
    if args.decode:
        decode(res, args.decode)
        write_json(args.json, res)
    table(res)


if __name__ == "__main__":
    main()
