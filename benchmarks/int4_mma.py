"""INT4 and INT8 weight-only matmuls of 1-16 rows through the Gluon kernel that loads the weights straight into the
tensor cores' registers (`kernels/lowbit_mma.py`), against the Triton kernels (`kernels/lowbit.py`: INT4
`wint_gemm`; INT8 the GEMV at one row and the tensor-core kernel from two, as `wint_linear` dispatches them) and
bf16, on the GPU (issue 38).

    python3 benchmarks/int4_mma.py --json benchmarks/results/int4-mma-h200.json [--no-sweep] [--decode MODEL]

First the checks: at Llama-3.1-8B's four layer shapes and two odd ones, INT4 and INT8, bf16 and fp16 rows (1, 2, 5,
8, 9, 16), with and without zero points, one with a bias, the words straight into registers and through the shared
ring, and the other ways of `WAYS` that `--ways` names (equal bits every way): the relative error against the
float32 product of the same codes (`ref`: x in float32 @ the dequantized weight), beside the Triton path's; the same
bits twice; a row alone against the same row within a batch of 16. Then the layers timed as CUDA-graph replays, each
launch on its own copy of the weight (past the L2), at 1, 2, 4, 8 and 16 rows (`--rows`): bf16 `ops.linear`, the
Triton path and `wint_mma` each way `--ways` names (default: straight into registers and through a ring of `RING`
steps), with the weight bytes each reads per second; then a sweep of `wint_mma`'s tilings (warps, 16-row tiles a
warp, K split, the words' ring depth: 0 straight into registers, else cp.async through shared memory) at 1, 8 and 16
rows (`--sweep-rows`). Then, with `--decode`, the engines of `ENGINES` one after the other (`--engines` picks some:
eight take more than one call's ten minutes). The table is printed last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from typing import Any, NamedTuple

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
# The ways the words come in, checked and timed (`--ways`): (STAGES, L2) of `wint_mma`'s config. `mma`: the
# default (`mma_config`'s: straight into registers one step ahead, an INT4 layer's loads asking the L2 for 128
# bytes, an INT8 layer's plain); `plain`: plain loads (the default before run 127); `ring`: through the shared
# ring; `l2_64` / `l2_128` / `l2_256`: each load asking the L2 to fetch that many bytes of the row (INT8 too);
# `wide`: INT4's words in 16-byte loads, each step's k-slots in their order (`MMA_WIDE`, the default up to 8 rows;
# the L2 hint as the default); `pairs`: in 8-byte pairs (the operand's own layout, the default before run 141).
WAYS = {
    "mma": None,
    "plain": (0, 0),
    "ring": (RING, 0),
    "l2_64": (0, 64),
    "l2_128": (0, 128),
    "l2_256": (0, 256),
    "wide": (0, 128, True),
    "pairs": (0, 128, False),
}


def way_config(way: str, m: int, n: int, k: int, bits: int) -> tuple[int, ...]:
    """`wint_mma`'s config for a layer, the words coming in the way `WAYS` names."""
    config = lowbit_mma.mma_config(m, n, k, bits=bits)
    if WAYS[way] is None or (way in ("wide", "pairs") and bits != 4):  # INT8 has no wide words: the default's
        return config
    return config[:3] + WAYS[way]


BITS = (4, 8)
SWEPT_STAGES = (0, 3, 4, 6)
# The rows the tilings are swept at by default (`--sweep-rows`; at 16, the words in registers, one and two 16-row
# tiles a warp at every split: the registers a thread set the programs a multiprocessor holds there, hence
# `mma_config`'s one-wave rule from 9 rows).
SWEPT_ROWS = (1, 8, 16)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def nbytes(w: lowbit.IntWeight) -> int:
    return sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.zeros) if t is not None)


def triton_path(x: torch.Tensor, w: lowbit.IntWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernels as the engine runs a layer without the Gluon one: INT4 `wint_gemm`; INT8 `wint_linear`
    with `INT8_MMA` off (the GEMV at one row, the tensor-core kernel from two)."""
    before, lowbit_mma.INT8_MMA = lowbit_mma.INT8_MMA, False
    try:
        return kernels.wint_gemm(x, w, bias) if w.bits == 4 else lowbit.wint_linear(x, w, bias)
    finally:
        lowbit_mma.INT8_MMA = before


def checks(res: dict[str, Any], gen: torch.Generator, quick: bool, ways: list[str]) -> None:
    out = res.setdefault("checks", [])
    rows = (1, 5, 16) if quick else (1, 2, 5, 8, 9, 16)
    for (name, n, k), sym, bits in itertools.product(SHAPES + ODD, (False, True), BITS):
        if quick and sym != (bits == 8) and name not in ("o", "odd-b"):
            continue
        w32 = torch.randn(n, k, device=DEV, generator=gen) / k**0.5
        w = lowbit.quantize_rtn(w32, bits, 128, sym)
        ref_w = lowbit.dequantize_weight(w)
        bias = torch.randn(n, device=DEV, dtype=torch.bfloat16, generator=gen) if name == "odd-b" else None
        for dt, m in itertools.product((torch.bfloat16, torch.float16), rows):
            x = torch.randn(m, k, device=DEV, dtype=dt, generator=gen)
            want = x.float() @ ref_w.T + (0 if bias is None else bias.float())
            triton_err = rel_err(triton_path(x, w, bias), want)
            first, first_wide = None, False
            for way in ways:  # the words straight into registers, through the shared ring, ...
                cfg = way_config(way, m, n, k, bits)
                got = lowbit_mma.wint_mma(x, w, bias, cfg)
                again = lowbit_mma.wint_mma(x, w, bias, cfg)
                row = {
                    "name": f"{name} int{bits} {'sym' if sym else 'zp'} {str(dt)[6:]} M={m} {way}",
                    "err": rel_err(got, want),
                    "triton_err": triton_err,
                    "same_twice": bool(torch.equal(got, again)),
                }
                if m == 16:
                    alone = torch.cat([lowbit_mma.wint_mma(x[i : i + 1], w, bias, cfg) for i in range(m)])
                    row["row_alone_equal"] = bool(torch.equal(alone, got))
                wide = lowbit_mma.full_config(m, n, k, bits, cfg)[5]
                if first is None:
                    first, first_wide = got, wide
                elif wide != first_wide:  # the same products, summed in another order inside each MMA
                    row["max_diff_to_registers"] = float((got.float() - first.float()).abs().max())
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


def timings(
    res: dict[str, Any], gen: torch.Generator, sweep: list[int], path: str, ways: list[str], ms: list[int]
) -> None:
    """The layers timed at rows `ms`, each way of `ways`; the tilings swept at the rows of `sweep` among them."""
    rows_out, sweep_out = res.setdefault("layers", []), res.setdefault("sweep", [])
    for (name, n, k), bits in itertools.product(SHAPES, BITS):
        wb = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=gen) / k**0.5
        w = lowbit.quantize_rtn(
            wb, bits, 128, bits == 8
        )  # the engine's schemes: INT4 zero points, INT8 symmetric
        ws = [w] + [w._replace(qweight=w.qweight.clone(), scales=w.scales.clone(),
                               zeros=None if w.zeros is None else w.zeros.clone())
                    for _ in range(copies_for(nbytes(w)) - 1)]  # fmt: skip
        bs = [wb] + [wb.clone() for _ in range(copies_for(2 * n * k) - 1)] if bits == 4 else []
        for m in ms:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
            row: dict[str, Any] = {"layer": name, "bits": bits, "n": n, "k": k, "m": m}
            if bs:
                row["bf16_us"] = graph_us(lambda i, x=x, bs=bs: ops.linear(x, bs[i]), len(bs))
            row["triton_us"] = graph_us(lambda i, x=x, ws=ws: triton_path(x, ws[i]), len(ws))
            row["mma_config"] = lowbit_mma.mma_config(m, n, k, bits=bits)
            for way in ways:
                cfg = way_config(way, m, n, k, bits)
                row[f"{way}_us"] = graph_us(
                    lambda i, x=x, c=cfg, ws=ws: lowbit_mma.wint_mma(x, ws[i], config=c), len(ws)
                )
                row[f"{way}_tbps"] = nbytes(w) / row[f"{way}_us"] / 1e6
            row["triton_tbps"] = nbytes(w) / row["triton_us"] / 1e6
            rows_out.append(row)
            print(row, flush=True)
            if m not in sweep:
                continue
            steps = k // (16 * (32 // bits))
            rule = lowbit_mma.mma_config(m, n, k, bits=bits)[2]
            # The ring's depths at the 8-row tiling; the other tilings with and without the ring (INT4); at 16 rows
            # (registers only) one and two 16-row tiles a warp, both bits, every split.
            tilings = [((4, 2), st) for st in (SWEPT_STAGES if m < 16 else (0,))]
            if m == 16:
                tilings += [(t, 0) for t in ((8, 1), (4, 1), (2, 1), (2, 2))]
            elif bits == 4:
                tilings += [(t, st) for t in ((4, 1), (8, 1), (2, 2), (4, 4)) for st in (0, RING)]
            splits = (1, 2, 4, 8, 16) if m == 16 else (rule // 2, rule, rule * 2, rule * 4)
            for (warps, reps), stages in tilings:
                for split in splits:
                    if split < 1 or steps % split or steps // split < 2:
                        continue
                    cfg = (16 * warps * reps, warps, split, stages)
                    try:
                        us = graph_us(
                            lambda i, x=x, c=cfg, ws=ws: lowbit_mma.wint_mma(x, ws[i], config=c), len(ws)
                        )
                    except Exception as e:  # noqa: BLE001 - a tiling that does not compile or fit
                        print(name, bits, m, cfg, type(e).__name__, str(e)[:200], flush=True)
                        us = float("nan")
                    sweep_out.append({"layer": name, "bits": bits, "m": m, "config": cfg, "us": us})
            done = [
                s
                for s in sweep_out
                if s["layer"] == name and s.get("bits", 4) == bits and s["m"] == m and s["us"] == s["us"]
            ]
            if done:
                best = min(done, key=lambda s: s["us"])
                print(f"  best {name} int{bits} M={m}: {best['config']} {best['us']:.1f} us", flush=True)
        del ws, bs
        torch.cuda.empty_cache()
        write_json(path, res)  # a layer at a time: a cut run keeps what it measured


def best_configs(res: dict[str, Any]) -> dict[tuple[int, int, int, int], tuple]:
    """The sweep's fastest tiling by (bits, N, K, M) at the rows it swept."""
    best: dict[tuple[int, int, int, int], tuple[float, tuple]] = {}
    for srow in res.get("sweep", []):
        n, k = next((n, k) for name, n, k in SHAPES if name == srow["layer"])
        key = (srow.get("bits", 4), n, k, srow["m"])
        if srow["us"] == srow["us"] and (key not in best or srow["us"] < best[key][0]):
            best[key] = (srow["us"], (*srow["config"], 0)[:4])  # a sweep before the ring: STAGES 0
    return {key: cfg for key, (_, cfg) in best.items()}


class Engine(NamedTuple):
    """An engine of `decode`: its arguments and the kernels' switches it runs under."""

    kw: dict[str, Any]  # engine arguments
    int4_mma: str = "1"  # TINYPAGED_INT4_MMA
    int8_mma: bool = False  # lowbit_mma.INT8_MMA
    swept: bool = False  # the sweep's fastest tilings (M = 1's at one row, M = 8's at 2-8, M = 16's at 9-16)
    way: tuple[int, int] | None = None  # (STAGES, L2) of mma_config; None: the default's
    mma_rows: int | None = None  # model/quant/lowbit.py's MMA_ROWS; None: the default
    wide: bool = True  # lowbit_mma.MMA_WIDE: INT4's words in 16-byte loads (up to 8 rows: the default)
    int8_min: int | None = None  # INT8_MMA_MIN_ROWS; None: the default


INT4, INT8 = {"quantization": "int4"}, {"quantization": "int8"}
ENGINES = {
    "bf16": Engine({}),
    "int4-triton": Engine(INT4, int4_mma="0"),
    "int4-mma": Engine(INT4),  # the default: straight into registers, the loads with the L2 hint
    # 9-16 rows through the kernel too, at mma_config's one-wave tilings (`int4-mma` in runs 130 and 132)
    "int4-mma16": Engine(INT4, mma_rows=16),
    "int4-mma-ring": Engine(INT4, way=WAYS["ring"]),
    # Batch 16 through the kernel too: at 16 rows it lost with the words in registers (168 a thread).
    "int4-mma-ring16": Engine(INT4, way=WAYS["ring"], mma_rows=16),
    "int4-mma-swept": Engine(INT4, swept=True),
    # 9-16 rows through the kernel at the sweep's 16-row tilings (the default split gives two waves there)
    "int4-mma16-swept": Engine(INT4, swept=True, mma_rows=16),
    "int4-mma-plain": Engine(INT4, way=WAYS["plain"]),
    "int4-mma-pairs": Engine(INT4, wide=False),  # the words in 8-byte pairs (the default before run 141)
    "int4-mma-l2-256": Engine(INT4, way=WAYS["l2_256"]),
    "int8-triton": Engine(INT8),
    # the default (2-16 rows through the kernel), then from one row
    "int8-mma": Engine(INT8, int8_mma=True),
    "int8-mma1": Engine(INT8, int8_mma=True, int8_min=1),
    "int8-mma-ring": Engine(INT8, int8_mma=True, way=WAYS["ring"], int8_min=1),
}


def decode(res: dict[str, Any], model: str, engines: list[str], path: str) -> None:
    """Batch-1 and batch-16 decode (benchmarks/lowbit.py's measurements), one engine of `ENGINES` after the other in
    this process: bf16; INT4 through the Triton kernel (`TINYPAGED_INT4_MMA=0`), through `wint_mma` at its default
    tilings with the words straight into registers (the default, its loads asking the L2 for 128 bytes; plain loads:
    `-plain`; 256 bytes: `-l2-256`; 8-byte word pairs: `-pairs`; also at 9-16 rows, `MMA_ROWS` 16: `int4-mma16`) and
    through a ring of `RING` steps in shared memory (also at 9-16 rows: `int4-mma-ring16`), and, where the sweep ran,
    at the sweep's fastest (up to 8 rows; `int4-mma16-swept` up to 16); INT8 (groups of 128, symmetric) through the
    Triton kernels (`INT8_MMA` off), through `wint_mma` at 2-16 rows (the default) and from one row (`-mma1`), and
    through the ring."""
    import os

    from common import free_llm, run_latency
    from lowbit import run_batch

    from tinypaged import LLM

    out = res.setdefault("decode", {})
    table = best_configs(res)
    default = lowbit_mma.mma_config
    stages, l2, wide = lowbit_mma.MMA_STAGES, lowbit_mma.MMA_L2, lowbit_mma.MMA_WIDE
    rows, int8_min, int8_on = lowbit.MMA_ROWS, lowbit.INT8_MMA_MIN_ROWS, lowbit_mma.INT8_MMA
    for name in engines:
        e = ENGINES[name]
        if e.swept and not table:
            continue  # no sweep to take the tilings from
        os.environ["TINYPAGED_INT4_MMA"] = e.int4_mma
        lowbit_mma._runs_on.cache_clear()  # the switch is read once a process: again for this engine
        # mma_config's ring depth (0: the words straight into registers) and INT4's L2 prefetch size
        lowbit_mma.MMA_STAGES, lowbit_mma.MMA_L2 = e.way or (stages, l2)
        lowbit_mma.MMA_WIDE = e.wide
        lowbit_mma.INT8_MMA = e.int8_mma
        lowbit.MMA_ROWS = e.mma_rows or rows
        lowbit.INT8_MMA_MIN_ROWS = e.int8_min or int8_min
        if e.swept:

            def swept(m: int, n: int, k: int, sms: int = 132, bits: int = 4) -> tuple[int, ...]:
                # the sweep's tiling (its words' L2 size the default's, as the sweep ran it) or the default
                cfg = table.get((bits, n, k, 1 if m == 1 else 8 if m <= 8 else 16))
                return default(m, n, k, sms, bits) if cfg is None else cfg + default(m, n, k, sms, bits)[4:]

            lowbit_mma.mma_config = swept
        try:
            llm = LLM(model=model, max_model_len=2048, max_num_seqs=64, **e.kw)
            lat = run_latency(llm, modes=("graphs",))
            b16 = run_batch(llm)
            b16.pop("tokens", None)
            out[name] = {"batch1": lat.get("graphs", {}), "batch16": b16}
            free_llm(llm)
        finally:
            lowbit_mma.mma_config = default
            lowbit_mma.MMA_STAGES, lowbit_mma.MMA_L2, lowbit_mma.MMA_WIDE = stages, l2, wide
            lowbit_mma.INT8_MMA = int8_on
            lowbit.MMA_ROWS, lowbit.INT8_MMA_MIN_ROWS = rows, int8_min
            os.environ.pop("TINYPAGED_INT4_MMA", None)
        b1 = out[name]["batch1"].get("decode_tokens_per_s", float("nan"))
        print(f"decode {name}: batch-1 {b1:.1f} tok/s, batch-16 {b16['decode_tokens_per_s']:.1f}", flush=True)
        write_json(path, res)  # an engine at a time: a cut run keeps what it measured


def table(res: dict[str, Any]) -> None:
    nan = float("nan")
    layers = res.get("layers", [])
    ways = [w for w in WAYS if any(f"{w}_us" in r for r in layers)]  # the ways of `WAYS` timed
    print(
        f"\n{'layer':8} {'bits':>4} {'M':>3} {'bf16 us':>8} {'triton us':>9} "
        + " ".join(f"{w + ' us':>12}" for w in ways)
        + " "
        + " ".join(f"{w + ' TB/s':>14}" for w in ways)
        + f" {'best us':>8}  best"
    )
    for r in layers:
        bits = r.get("bits", 4)
        cands = [
            s
            for s in res.get("sweep", [])
            if (s["layer"], s.get("bits", 4), s["m"]) == (r["layer"], bits, r["m"]) and s["us"] == s["us"]
        ]
        best = min(cands, key=lambda s: s["us"]) if cands else None
        print(
            f"{r['layer']:8} {bits:>4} {r['m']:>3} {r.get('bf16_us', nan):8.1f} {r['triton_us']:9.1f} "
            + " ".join(f"{r.get(w + '_us', nan):12.1f}" for w in ways)
            + " "
            + " ".join(f"{r.get(w + '_tbps', nan):14.2f}" for w in ways)
            + f" {best['us'] if best else nan:8.1f}  {best['config'] if best else ''}"
        )
    for bits, m in sorted({(r.get("bits", 4), r["m"]) for r in layers}):
        rows = [r for r in layers if (r.get("bits", 4), r["m"]) == (bits, m)]
        t = sum(r.get("triton_us", nan) for r in rows)
        b = sum(r["bf16_us"] for r in layers if r["m"] == m and "bf16_us" in r)
        sums = {w: sum(r.get(f"{w}_us", nan) for r in rows) for w in ways}
        print(
            f"INT{bits}, a layer's four matmuls at M={m}: bf16 {b:.1f} us, triton {t:.1f}, "
            + ", ".join(f"{w} {u:.1f} ({t / u:.2f}x triton)" for w, u in sums.items())
        )
    dec = res.get("decode", {})
    if dec:
        base = dec.get("bf16", {})
        print(f"\n{'engine':15} {'b1 tok/s':>9} {'x bf16':>7} {'b16 tok/s':>10} {'x bf16':>7}")
        for name, r in dec.items():
            b1, b16 = (
                r["batch1"].get("decode_tokens_per_s", nan),
                r["batch16"]["decode_tokens_per_s"],
            )
            x1 = b1 / base["batch1"]["decode_tokens_per_s"] if base else nan
            x16 = b16 / base["batch16"]["decode_tokens_per_s"] if base else nan
            print(f"{name:15} {b1:9.1f} {x1:7.3f} {b16:10.1f} {x16:7.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--quick-checks", action="store_true", help="fewer shapes and row counts")
    ap.add_argument("--skip-layers", action="store_true")
    ap.add_argument("--decode", metavar="MODEL", help="also the engines' decode on this checkpoint")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES), help="with --decode")
    ap.add_argument(
        "--ways",
        nargs="+",
        choices=list(WAYS),
        default=["mma", "ring"],
        help="the words' ways checked and timed",
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="the layers' rows timed")
    ap.add_argument(
        "--sweep-rows",
        type=int,
        nargs="+",
        default=list(SWEPT_ROWS),
        help="of --rows, those the tilings are swept at",
    )
    ap.add_argument(
        "--resume", action="store_true", help="start from --json's results (a sweep for --decode)"
    )
    args = ap.parse_args()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.resume:
        with open(args.json) as f:
            res = json.load(f)
    gen = torch.Generator(device=DEV).manual_seed(0)
    lowbit_mma.INT8_MMA = (
        True  # the kernel called directly on INT8 layers (`triton_path` turns it off for its own)
    )
    if not args.skip_checks:
        checks(res, gen, args.quick_checks, args.ways)
        write_json(args.json, res)
    if not args.skip_layers:
        timings(res, gen, [] if args.no_sweep else args.sweep_rows, args.json, args.ways, args.rows)
        write_json(args.json, res)
    if args.decode:
        decode(res, args.decode, args.engines, args.json)
        write_json(args.json, res)
    table(res)


if __name__ == "__main__":
    main()
