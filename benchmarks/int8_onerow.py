"""INT8 at one row (issue 38): the Triton GEMV's tilings (rows and columns a step, K split, warps; also bf16's
GEMV's shape, a few rows of long runs in many programs) and the Gluon kernel's one-row tilings with and without
the L2 prefetch hint, graph-timed at the 8B shapes (each launch on its own copy of the weight, as `int4_mma.py`
times them) and checked against the float32 product of the same codes; then batch-1 / batch-16 decode of INT8 at
the default tilings and at each layer's fastest GEMV tiling, beside bf16, in one process. `--no-mma` leaves the
Gluon kernel out. About 170 tilings a layer by default: the JSON is written a layer at a time.

    tinypaged weights random --config llama-3.1-8b --out /tmp/m8b
    python3 benchmarks/int8_onerow.py --model /tmp/m8b --json benchmarks/results/int8-onerow-h200.json

Run 131 (H200) ran a draft that also swept the GEMV's words a step ahead (`AHEAD`, since taken out: it lost in
the engine, runs 129-132); its engine ran each layer's tiling fastest with or without AHEAD, always without it
(qkv's and o's fastest were with it); this one picks among tilings without, and sweeps the few-row shapes too.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import int4_mma as base
import torch

from tinypaged.kernels import lowbit as kernels
from tinypaged.kernels import lowbit_mma
from tinypaged.model.quant import lowbit


def sweep(res: dict[str, Any], path: str, mma: bool) -> dict[tuple[int, int], tuple]:
    """Every tiling timed (the Gluon kernel's where `mma`), the JSON written a layer at a time; the fastest GEMV
    config by (N, K)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    fastest = {}
    for name, n, k in base.SHAPES:
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5
        w = lowbit.quantize_rtn(wb, 8, 128, True)  # the engine's INT8: symmetric, groups of 128
        copies = base.copies_for(base.nbytes(w))
        ws = [w] + [w._replace(qweight=w.qweight.clone(), scales=w.scales.clone()) for _ in range(copies - 1)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        want = x.float() @ lowbit.dequantize_weight(w).T
        runs = [  # run 131's tilings: 32-128 rows a program, a group or two a step, K split
            ("gemv", (bn, bk, split, warps))
            for bn, bk, split, warps in itertools.product((32, 64, 128), (128, 256), (2, 4, 8, 16), (4, 8))
            if (k // bk) % split == 0 and k // bk // split >= 2 and (warps == 4 or bn == 128)
        ]
        # bf16's GEMV reads 3.95 TB/s in the engine with 4 rows of 1,024 columns (2 KB runs) a program, many
        # programs, K unsplit (kernels/gemv.py); INT8's reads 2.77 at 64 rows of 128 (run 135). Its shape here:
        # 4-16 rows, runs of 128-1,024 bytes (past a group: a scale a word), one to four warps.
        runs += [
            ("gemv", (bn, bk, split, warps))
            for bn, bk, split, warps in itertools.product(
                (4, 8, 16), (128, 256, 512, 1024), (1, 2, 4), (1, 2, 4)
            )
            if (k // bk) % split == 0 and bn * bk // 4 >= 32 * warps
        ]
        runs += (
            []
            if not mma
            else [
                ("mma", (16 * warps * reps, warps, split, 0, l2))
                for (warps, reps), split, l2 in itertools.product(
                    ((4, 2), (8, 1), (4, 1), (2, 1), (2, 2)), (2, 4, 8, 16), (0, 128)
                )
                if (k // 64) % split == 0 and k // 64 // split >= 2
            ]
        )
        rows = []
        for path, cfg in runs:
            fn = kernels.wint_gemv if path == "gemv" else lowbit_mma.wint_mma
            try:
                us = base.graph_us(lambda i, c=cfg, f=fn, x=x, ws=ws: f(x, ws[i], config=c), len(ws))
            except Exception as e:  # noqa: BLE001 - a tiling that does not compile or fit
                print(name, path, cfg, type(e).__name__, str(e)[:120], flush=True)
                continue
            err = base.rel_err(fn(x, w, config=cfg), want)
            rows.append({"layer": name, "path": path, "config": cfg, "us": us, "err": err, "ok": err < 5e-3})
        default = kernels.gemv_config(1, n, k, 128)
        d = next(r for r in rows if r["path"] == "gemv" and r["config"] == default)
        best = {
            p: min((r for r in rows if r["path"] == p and r["ok"]), key=lambda r: r["us"])
            for p in ("gemv", "mma")
            if any(r["path"] == p for r in rows)
        }
        fastest[n, k] = best["gemv"]["config"]
        res["sweep"] += rows
        base.write_json(path, res)  # a layer at a time: a cut run keeps what it measured
        gluon = f"; fastest Gluon {best['mma']['config']} {best['mma']['us']:.1f}" if "mma" in best else ""
        print(
            f"{name}: default GEMV {default} {d['us']:.1f} us; fastest GEMV {best['gemv']['config']} "
            f"{best['gemv']['us']:.1f}{gluon}; {sum(not r['ok'] for r in rows)} outside 5e-3",
            flush=True,
        )
        del ws
        torch.cuda.empty_cache()
    return fastest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument(
        "--no-mma", action="store_true", help="the GEMV's tilings only (the sweep in fewer minutes)"
    )
    args = ap.parse_args()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "sweep": [], "decode": {}}
    fastest = sweep(res, args.json, not args.no_mma)
    base.write_json(args.json, res)
    base.decode(res, args.model, ["bf16", "int8-mma"], args.json)
    plain = kernels.gemv_config
    kernels.gemv_config = lambda m, n, k, group, sms=132: (
        fastest[n, k] if m == 1 and (n, k) in fastest else plain(m, n, k, group, sms)
    )
    base.ENGINES["int8-gemv-fastest"] = base.ENGINES["int8-mma"]
    try:
        base.decode(res, args.model, ["int8-gemv-fastest"], args.json)
    finally:
        kernels.gemv_config = plain
    res["fastest"] = {f"{n}x{k}": cfg for (n, k), cfg in fastest.items()}
    base.write_json(args.json, res)
    print(f"\n{'engine':18} {'b1 tok/s':>9} {'b16 tok/s':>10}")
    for name, r in res["decode"].items():
        b1 = r["batch1"].get("decode_tokens_per_s", float("nan"))
        print(f"{name:18} {b1:9.1f} {r['batch16']['decode_tokens_per_s']:10.1f}")


if __name__ == "__main__":
    main()
