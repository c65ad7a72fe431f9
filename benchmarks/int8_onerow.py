"""INT8 at one row (issue 38): the Triton GEMV with each word's four products in one PTX chain (`gemv_ptx`, the
default, at `gemv_config`'s one-wave tilings) beside the float32 route the compiler makes of the same arithmetic
(`TINYPAGED_INT8_GEMV_PTX=0`, at its own tilings), on the GPU.

    tinypaged weights random --config llama-3.1-8b --out /tmp/m8b
    python3 benchmarks/int8_onerow.py --model /tmp/m8b --json benchmarks/results/int8-onerow-h200.json

First the checks: at the 8B layer shapes and two odd ones, symmetric and with zero points, bf16 and fp16, one with
a bias: the PTX chain's output equal to the float32 route's at the same tiling (the PTX default's), bit for bit,
and both against the float32 product of the same codes; an 8-byte-misaligned row (which takes the float32 route)
right too. Then the GEMV's one-row tilings (`TILINGS`: 32-128 rows a program, K split 1-16 ways, and a few-row
shape like bf16's GEMV) graph-timed both ways at the four 8B layers, each launch on its own copy of the weight (as
`int4_mma.py` times them). Then the engines of `--engines` one after the other in one process (`--passes`
times): bf16, INT8 as it is (`int8`), with the float32 route (`int8-plain`), at each layer's fastest PTX tiling
from the sweep (`int8-fastest`), and INT4 as it is (`int4`), batch 1 and batch 16. The table is printed last.

Run 131 (H200) ran an earlier form of this script (the float32 route's tilings and the Gluon kernel's):
`int8-onerow-h200-run131.json`.
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import int4_mma as base
import torch

from tinypaged.kernels import lowbit as kernels
from tinypaged.model.quant import lowbit

# (BLOCK_N, BLOCK_K, SPLIT, num_warps) at one row: the default's neighbours (32-128 rows of one group a step, K
# split 2-16; run 131's fastest among them) and bf16's GEMV's shape (a few rows of long runs, K hardly split).
TILINGS = [
    *[(bn, 128, split, 4) for bn, split in itertools.product((32, 64, 128), (1, 2, 4, 8, 16))],
    *[(128, 128, split, 8) for split in (4, 8, 16)],
    *[(64, 128, split, 2) for split in (4, 8)],
    (16, 512, 1, 4),
    (16, 512, 2, 4),
    (8, 1024, 1, 4),
]


def with_ptx(on: bool, fn: Any, *args: Any, **kw: Any) -> Any:
    """fn(*args, **kw) with the GEMV's PTX chain on or off."""
    before, kernels.INT8_GEMV_PTX = kernels.INT8_GEMV_PTX, on
    try:
        return fn(*args, **kw)
    finally:
        kernels.INT8_GEMV_PTX = before


def checks(res: dict[str, Any], gen: torch.Generator) -> None:
    out = res.setdefault("checks", [])
    for (name, n, k), sym, dt in itertools.product(
        base.SHAPES + base.ODD, (True, False), (torch.bfloat16, torch.float16)
    ):
        w = lowbit.quantize_rtn(torch.randn(n, k, device="cuda", generator=gen) / k**0.5, 8, 128, sym)
        bias = torch.randn(n, device="cuda", dtype=dt, generator=gen) if name == "odd-b" else None
        buf = torch.randn(k + 1, device="cuda", dtype=dt, generator=gen)
        for aligned in (True, False):
            x = (
                buf[None, :k] if aligned else buf[None, 1:]
            )  # 2 bytes past an 8-byte boundary: the float32 route
            want = x.float() @ lowbit.dequantize_weight(w).T + (0 if bias is None else bias.float())
            cfg = kernels.gemv_config(1, n, k, 128, ptx=True)  # both routes one tiling: the same sums' order
            ptx = with_ptx(True, kernels.wint_gemv, x, w, bias, cfg)
            plain = with_ptx(False, kernels.wint_gemv, x, w, bias, cfg)
            row = {
                "name": f"{name} {'sym' if sym else 'zp'} {str(dt)[6:]}{'' if aligned else ' misaligned'}",
                "took_ptx": kernels.gemv_ptx(x, w),
                "err": base.rel_err(ptx, want),
                "plain_err": base.rel_err(plain, want),
                "equal_bits": bool(torch.equal(ptx, plain)),
            }
            row["ok"] = row["err"] < 5e-3 and row["equal_bits"] and row["took_ptx"] == aligned
            out.append(row)
            if not row["ok"]:
                print("CHECK FAILED", row, flush=True)
    bad = sum(not c["ok"] for c in out)
    print(
        f"checks: {len(out) - bad} of {len(out)} pass; worst err {max(c['err'] for c in out):.2e}", flush=True
    )


def sweep(res: dict[str, Any], path: str, tilings: list[tuple[int, ...]]) -> dict[tuple[int, int], tuple]:
    """Every tiling timed both ways, the JSON written a layer at a time; the fastest PTX tiling by (N, K)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    fastest = {}
    for name, n, k in base.SHAPES:
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5
        w = lowbit.quantize_rtn(wb, 8, 128, True)  # the engine's INT8: symmetric, groups of 128
        ws = [w] + [w._replace(qweight=w.qweight.clone(), scales=w.scales.clone())
                    for _ in range(base.copies_for(base.nbytes(w)) - 1)]  # fmt: skip
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        default = kernels.gemv_config(1, n, k, 128, ptx=True)
        plain_default = kernels.gemv_config(1, n, k, 128)
        rows = []
        configs = list(dict.fromkeys([default, plain_default, *tilings]))
        for cfg, ptx in itertools.product(configs, (True, False)):
            bn, bk, split, _ = cfg
            if (k // bk) % split:
                continue
            try:
                us = base.graph_us(
                    lambda i, c=cfg, p=ptx, x=x, ws=ws: with_ptx(p, kernels.wint_gemv, x, ws[i], config=c),
                    len(ws),
                )
            except Exception as e:  # noqa: BLE001 - a tiling that does not compile or fit
                print(name, cfg, ptx, type(e).__name__, str(e)[:120], flush=True)
                continue
            rows.append(
                {"layer": name, "config": cfg, "ptx": ptx, "us": us, "tbps": base.nbytes(w) / us / 1e6}
            )
        pick = {p: min((r for r in rows if r["ptx"] == p), key=lambda r: r["us"]) for p in (True, False)}
        at_default = {
            r["ptx"]: r["us"] for r in rows if r["config"] == (default if r["ptx"] else plain_default)
        }
        fastest[n, k] = pick[True]["config"]
        res["gemv_sweep"] += rows
        res.setdefault("layers", []).append(
            {"layer": name, "default": default, "plain_default": plain_default, "ptx_us": at_default[True],
             "plain_us": at_default[False],
             "fastest_ptx": pick[True], "fastest_plain": pick[False]}
        )  # fmt: skip
        base.write_json(path, res)  # a layer at a time: a cut run keeps what it measured
        print(
            f"{name}: PTX at {default} {at_default[True]:.1f} us, plain at {plain_default} "
            f"{at_default[False]:.1f}; fastest PTX {pick[True]['config']} {pick[True]['us']:.1f}, "
            f"plain {pick[False]['config']} {pick[False]['us']:.1f}",
            flush=True,
        )
        del ws
        torch.cuda.empty_cache()
    return fastest


def engines(res: dict[str, Any], model: str, path: str, names: list[str], fastest: dict, tag: str) -> None:
    """The engines of `names`, one after the other in this process, as `int4_mma.decode` runs them."""
    base.ENGINES.update(int8=base.ENGINES["int8-mma"], int4=base.ENGINES["int4-mma"])
    plain_config = kernels.gemv_config
    for name in names:
        if name == "int8-fastest" and not fastest:
            continue
        key = f"{name}{tag}"
        base.ENGINES[key] = base.ENGINES["int8" if name.startswith("int8") else name]
        if name == "int8-fastest":
            kernels.gemv_config = lambda m, n, k, group, sms=132, ptx=False: (
                fastest[n, k] if m == 1 and (n, k) in fastest else plain_config(m, n, k, group, sms, ptx)
            )
        try:
            with_ptx(name != "int8-plain", base.decode, res, model, [key], path)
        finally:
            kernels.gemv_config = plain_config


def table(res: dict[str, Any]) -> None:
    print(f"\n{res['device']}")
    if res.get("checks"):
        bad = sum(not c["ok"] for c in res["checks"])
        print(f"checks: {len(res['checks']) - bad} of {len(res['checks'])} pass")
    if res.get("layers"):
        print(
            f"\n{'layer':8} {'PTX default':>20} {'us':>6} {'plain default':>20} {'us':>6}   fastest PTX (us)"
            "          fastest plain"
        )
        for r in res["layers"]:
            fp, fl = r["fastest_ptx"], r["fastest_plain"]
            print(
                f"{r['layer']:8} {str(tuple(r['default'])):>20} {r['ptx_us']:6.1f} "
                f"{str(tuple(r['plain_default'])):>20} {r['plain_us']:6.1f}   "
                f"{str(tuple(fp['config'])):20} {fp['us']:5.1f}   {str(tuple(fl['config'])):20} {fl['us']:5.1f}"
            )
        four = {k: sum(r[k] for r in res["layers"]) for k in ("ptx_us", "plain_us")}
        print(f"a layer's four at the defaults: PTX {four['ptx_us']:.1f} us, plain {four['plain_us']:.1f}")
    dec = res.get("decode", {})
    if dec:
        bf16 = {k[4:]: v for k, v in dec.items() if k.startswith("bf16")}  # by pass: "/1", "/2" or ""
        print(f"\n{'engine':18} {'b1 tok/s':>9} {'x bf16':>7} {'b16 tok/s':>10} {'x bf16':>7}")
        for name, r in dec.items():
            ref = bf16.get(name[name.find("/") :] if "/" in name else "")
            b1 = r["batch1"].get("decode_tokens_per_s", float("nan"))
            b16 = r["batch16"]["decode_tokens_per_s"]
            r1 = b1 / ref["batch1"]["decode_tokens_per_s"] if ref else float("nan")
            r16 = b16 / ref["batch16"]["decode_tokens_per_s"] if ref else float("nan")
            print(f"{name:18} {b1:9.1f} {r1:7.3f} {b16:10.1f} {r16:7.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="the 8B weights, for --engines")
    ap.add_argument("--json", required=True)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--engines", nargs="*", default=["bf16", "int8", "int8-plain", "int8-fastest", "int4"],
                    choices=["bf16", "int8", "int8-plain", "int8-fastest", "int4"])  # fmt: skip
    ap.add_argument("--passes", type=int, default=1, help="the engines this many times, in turn")
    ap.add_argument("--fastest-from", help="with --skip-sweep: an earlier run's JSON, for `int8-fastest`")
    args = ap.parse_args()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "gemv_sweep": [], "decode": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    if not args.skip_checks:
        checks(res, gen)
        base.write_json(args.json, res)
    if args.skip_sweep:
        earlier = json.load(open(args.fastest_from))["fastest"] if args.fastest_from else {}
        fastest = {tuple(map(int, nk.split("x"))): tuple(cfg) for nk, cfg in earlier.items()}
    else:
        fastest = sweep(res, args.json, TILINGS)
    res["fastest"] = {f"{n}x{k}": cfg for (n, k), cfg in fastest.items()}
    base.write_json(args.json, res)
    if args.engines and args.model:
        for p in range(args.passes):
            engines(res, args.model, args.json, args.engines, fastest, f"/{p + 1}" if args.passes > 1 else "")
    base.write_json(args.json, res)
    table(res)


if __name__ == "__main__":
    main()
