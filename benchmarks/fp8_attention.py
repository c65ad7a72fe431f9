"""Paged attention over an FP8 (E4M3) KV cache against the bf16 cache, on one GPU: checks, then decode timing.

Checks: decode and a mixed batch (prefill chunks beside decodes) over an E4M3 cache with per-layer k/v scales,
bf16 and fp16 queries, against `ops.ref_paged_attention` on the dequantized cache (float32), for each tile and
for the Gluon decode kernel (kernels/attention_fp8.py: its own split choice, and 4 splits).
Timing: decode steps of 64-256 sequences at 512-2048 tokens of context (8B shape: 32 query heads, 8 KV heads,
128 dims, block size 16), as CUDA-graph replays over caches that exceed the L2; bf16 against FP8 with each
variant of the decode tile and through the Gluon kernel (`fp8 gluon`). Bytes are the K/V bytes read; the FP8
cache reads half of bf16's. `--batches` / `--contexts` pick other steps; `--ragged` draws each sequence's context
uniform in [ctx / 4, 7 ctx / 4) and passes the engine's longest-first order; `--gluon-splits` also times the
Gluon kernel at forced split counts (its split rule's sweep); `--prefill` times prompt-chunk steps over both
caches (the chunked prefill of the KV-bound workload reads the FP8 cache).

    python3 benchmarks/fp8_attention.py --json $OUT/fp8-attention.json
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from common import write_json
from kernel_speed import bench, graph_ms, paged_batch, rel_err

import tinypaged.kernels as tk
from tinypaged import ops
from tinypaged.model.quant.e4m3 import dequantize, quantize

AttnConfig = tk.attention.AttnConfig
HQ, HKV, D, BS = 32, 8, 128, 16


def to_fp8(kv: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """A bf16 cache as E4M3 with one scale for K and one for V (amax / 448, as calibration takes them)."""
    k_scale = float(kv[0].float().abs().amax()) / 448
    v_scale = float(kv[1].float().abs().amax()) / 448
    q8 = torch.stack([quantize(kv[0], torch.tensor(k_scale)), quantize(kv[1], torch.tensor(v_scale))])
    return q8, k_scale, v_scale


def variants(q: torch.Tensor) -> dict[str, tuple[AttnConfig, AttnConfig]]:
    """The FP8 decode tiles to time: the default (the bf16 tile: 64 keys, 2 stages, 4 warps), 128-key tiles (the
    bf16 tile's bytes), three stages."""
    dec, pre = tk.attention.default_configs(q, HQ // HKV)
    out = {"64x2": (dec, pre), "128x2": (_with(dec, block_n=128, maxnreg=None), pre)}
    out["64x3"] = (_with(dec, num_stages=3), pre)
    return out


def _with(cfg: AttnConfig, **kw: Any) -> AttnConfig:
    return AttnConfig(**{**cfg.__dict__, **kw})


@contextlib.contextmanager
def gluon(on: bool = True) -> Iterator[None]:
    """Decode steps over an FP8 cache through the Gluon kernel (kernels/attention_fp8.py) at any batch while
    active (`on`), or through the Triton kernel (not `on`)."""
    mod = tk.attention_fp8
    before = mod.FP8_DECODE_MMA, mod.MIN_PROGRAMS
    mod.FP8_DECODE_MMA, mod.MIN_PROGRAMS = on, 0
    try:
        yield
    finally:
        mod.FP8_DECODE_MMA, mod.MIN_PROGRAMS = before


def checks(res: dict[str, Any]) -> None:
    for dtype in (torch.bfloat16, torch.float16):
        for name, q_lens, ctx in [
            ("decode", [1] * 12, [5, 17, 64, 100, 300, 513, 1000, 1, 31, 47, 250, 700]),
            ("mixed", [1, 37, 1, 200, 1, 5], [900, 0, 64, 129, 3, 40]),
        ]:
            q, kv, bt, sl, qsl = paged_batch(q_lens, ctx, HQ, HKV, D, BS, seed=len(q_lens))
            q = q.to(dtype)
            kv8, ks, vs = to_fp8(kv)
            deq = torch.stack([dequantize(kv8[0], torch.tensor(ks)), dequantize(kv8[1], torch.tensor(vs))])
            ref = ops.ref_paged_attention(q.float(), deq.float(), bt, sl, qsl, D**-0.5)
            runs = {v: (cfgs, None, False) for v, cfgs in variants(q).items()}
            runs |= {"gluon": (None, None, True), "gluon-split4": (None, 4, True)}
            for variant, (cfgs, splits, on) in runs.items():
                with gluon(on):
                    out = tk.paged_attention(
                        q,
                        kv8,
                        bt,
                        sl,
                        qsl,
                        D**-0.5,
                        configs=cfgs,
                        k_scale=ks,
                        v_scale=vs,
                        num_kv_splits=splits,
                    )
                err = rel_err(out, ref)
                # A Gluon variant that the launcher did not route to the kernel (`usable` false on this device)
                # would only check the Triton kernel again: a failure, not a pass.
                with gluon(on):
                    routed = tk.attention_fp8.usable(q, kv8, None, 1, len(q_lens))
                ok = err < 5e-3 and routed == on
                res["checks"].append(
                    {"case": name, "q_dtype": str(dtype), "variant": variant, "rel_err": err, "gluon": routed,
                     "ok": ok}
                )  # fmt: skip
                print(
                    f"check {name:6s} {str(dtype):15s} {variant:12s} rel_err {err:.2e} gluon {routed} "
                    f"{'ok' if ok else 'FAIL'}"
                )


def batch_sets(batch: int, ctx: int, ragged: bool) -> list[tuple]:
    """Enough decode batches to pass the L2 between replays: `batch` sequences at `ctx - 1` keys each, or (ragged)
    at keys uniform in [ctx / 4, 7 ctx / 4), each with the longest-first order the engine passes (`seq_order`)."""
    n_sets = max(2, -(-256 * 2**20 // (batch * ctx * HKV * D * 2 * 2)))
    sets = []
    for i in range(n_sets):
        gen = torch.Generator().manual_seed(i)
        lens = (
            torch.randint(ctx // 4, 7 * ctx // 4, (batch,), generator=gen)
            if ragged
            else torch.full((batch,), ctx - 1)
        )
        q, kv, bt, sl, qsl = paged_batch([1] * batch, lens.tolist(), HQ, HKV, D, BS, seed=i)
        order = torch.argsort(sl, descending=True, stable=True).to(torch.int32) if ragged else None
        sets.append((q, kv, bt, sl, qsl, order, int(sl.max())))
    return sets


def timing(
    res: dict[str, Any], batches: list[int], contexts: list[int], gluon_splits: list[int], ragged: bool
) -> None:
    def run(
        s: tuple,
        cache: torch.Tensor,
        cfgs: Any = None,
        ks: float = 1.0,
        vs: float = 1.0,
        n: int | None = None,
    ):
        q, _, bt, sl, qsl, order, longest = s
        return lambda: tk.paged_attention(
            q, cache, bt, sl, qsl, D**-0.5, max_query_len=1, max_seq_len=longest, configs=cfgs,
            k_scale=ks, v_scale=vs, num_kv_splits=n, seq_order=order,
        )  # fmt: skip

    for batch in batches:
        for ctx in contexts:
            sets = batch_sets(batch, ctx, ragged)
            row: dict[str, Any] = {"batch": batch, "ctx": ctx, "ragged": ragged}
            row["bf16_us"] = graph_ms([run(s, s[1]) for s in sets]) * 1e3
            fp8_sets = [(s, *to_fp8(s[1])) for s in sets]
            for variant, cfgs in variants(sets[0][0]).items():
                try:
                    with gluon(False):
                        row[f"fp8 {variant}_us"] = (
                            graph_ms([run(s, c, cfgs, ks, vs) for s, c, ks, vs in fp8_sets]) * 1e3
                        )
                except Exception as e:  # a tile past the shared memory: recorded, the others go on
                    row[f"fp8 {variant}_error"] = f"{type(e).__name__}: {str(e)[:120]}"
            try:
                with gluon():
                    # timed only where the launcher routes to it: else the column would time the Triton kernel
                    assert tk.attention_fp8.usable(sets[0][0], fp8_sets[0][1], None, 1, batch), (
                        "not routed to Gluon"
                    )
                    row["fp8 gluon_us"] = (
                        graph_ms([run(s, c, None, ks, vs) for s, c, ks, vs in fp8_sets]) * 1e3
                    )
                    row["gluon_default_splits"] = tk.attention_fp8.splits(batch, HKV, sets[0][-1], sets[0][0])
                    # the Gluon kernel at forced split counts (its split rule's sweep)
                    for n in gluon_splits:
                        row[f"fp8 gluon/{n}_us"] = (
                            graph_ms([run(s, c, None, ks, vs, n) for s, c, ks, vs in fp8_sets]) * 1e3
                        )
            except Exception as e:  # noqa: BLE001 - recorded, the others go on
                row["fp8 gluon_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            row["bf16_TBps"] = (
                sum(int(s[3].sum()) for s in sets) / len(sets) * HKV * D * 4 / row["bf16_us"] / 1e6
            )
            res["decode"].append(row)
            print(row, flush=True)
            del sets, fp8_sets
            torch.cuda.empty_cache()


# The prefill tiles `--prefill-tiles` times over the FP8 cache: (BLOCK_M query rows, BLOCK_N keys, warps, stages).
PREFILL_TILES = [
    (m, n, w, st)
    for m, w in ((256, 8), (128, 8), (128, 4))
    for n in (32, 64, 128)
    for st in (2, 3)
    if (m, w) != (128, 4) or n > 32
]


def prefill_timing(res: dict[str, Any], shapes: list[str], tiles: bool) -> None:
    """Steps of prompt chunks only, over the bf16 cache and the FP8 one (the default tiles; with `tiles`, the FP8
    one at each of `PREFILL_TILES` too): each shape `NxQ[+C]` is N sequences of Q new tokens after C cached ones
    (causal), as chunked prefill runs them."""
    for shape in shapes:
        row = prefill_row(shape, tiles)
        res.setdefault("prefill", []).append(row)
        print(row, flush=True)
        torch.cuda.empty_cache()


def prefill_row(shape: str, tiles: bool) -> dict[str, Any]:
    """One `--prefill` shape timed over both caches (and the FP8 one at each of `PREFILL_TILES`, with `tiles`)."""
    n, rest = shape.split("x")
    new, _, ctx = rest.partition("+")
    q_lens, ctx_lens = [int(new)] * int(n), [int(ctx or 0)] * int(n)
    q, kv, bt, sl, qsl = paged_batch(q_lens, ctx_lens, HQ, HKV, D, BS, seed=0)
    q8, k_scale, v_scale = to_fp8(kv)
    # causal FLOPs: each new token against its own context (QK and PV, 2 FLOPs a multiply-add)
    flops = sum(4 * HQ * D * (c * qn + qn * (qn + 1) / 2) for qn, c in zip(q_lens, ctx_lens, strict=True))

    def run(cache: torch.Tensor, ks: float = 1.0, vs: float = 1.0, cfgs: Any = None):
        return lambda: tk.paged_attention(
            q, cache, bt, sl, qsl, D**-0.5, max_query_len=int(new), max_seq_len=int(sl.max()),
            k_scale=ks, v_scale=vs, configs=cfgs,
        )  # fmt: skip

    row: dict[str, Any] = {"shape": shape, "tokens": sum(q_lens), "gflop": flops / 1e9}
    # Timed as launches (a chunk step's attention takes hundreds of microseconds: no host time to hide), not in
    # a CUDA graph: run 124's capture of these launches failed (`cudaErrorStreamCaptureInvalidated`).
    row["bf16_us"] = bench(run(kv)) * 1e3
    row["fp8_us"] = bench(run(q8, k_scale, v_scale)) * 1e3
    row["bf16_tflops"], row["fp8_tflops"] = (flops / row[k] / 1e6 for k in ("bf16_us", "fp8_us"))
    if tiles:
        dec = tk.attention.default_configs(q, HQ // HKV)[0]
        want = run(kv)()
        for m, n, w, st in PREFILL_TILES:
            key = f"fp8 {m}x{n}/{w}w/{st}s"
            cfgs = (dec, AttnConfig(m, n, num_warps=w, num_stages=st))
            try:
                got = run(q8, k_scale, v_scale, cfgs)()
                row[key + "_err"] = rel_err(got, want)
                row[key + "_us"] = bench(run(q8, k_scale, v_scale, cfgs)) * 1e3
            except Exception as e:  # noqa: BLE001 - a tile past the shared memory: recorded, the others go on
                row[key + "_error"] = f"{type(e).__name__}: {str(e)[:120]}"
        timed = {k[:-3]: v for k, v in row.items() if k.startswith("fp8 ") and k.endswith("_us")}
        if timed:
            best = min(timed, key=timed.__getitem__)
            row["fp8_best_tile"], row["fp8_best_us"] = best[4:], timed[best]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--batches", type=int, nargs="*", default=[64, 128, 256], help="decode sequences timed")
    ap.add_argument(
        "--contexts", type=int, nargs="+", default=[512, 1024, 2048], help="their context lengths"
    )
    ap.add_argument(
        "--gluon-splits", type=int, nargs="*", default=[], help="also the Gluon kernel at these splits"
    )
    ap.add_argument(
        "--ragged", action="store_true", help="contexts uniform in [ctx / 4, 7 ctx / 4), longest first"
    )
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument(
        "--prefill-tiles", action="store_true", help="with --prefill: the FP8 cache at each of PREFILL_TILES"
    )
    ap.add_argument(
        "--prefill",
        nargs="*",
        default=[],
        metavar="NxQ[+C]",
        help="also prompt-chunk steps (e.g. 2x4096, 4x1024+2048)",
    )
    args = ap.parse_args()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "checks": [], "decode": []}
    if not args.skip_checks:
        checks(res)
        write_json(args.json, res)
    if args.prefill:
        prefill_timing(res, args.prefill, args.prefill_tiles)
        write_json(args.json, res)
    timing(res, args.batches, args.contexts, args.gluon_splits, args.ragged)
    write_json(args.json, res)
    for r in res.get("prefill", []):
        print(
            f"prefill {r['shape']:>12}: bf16 {r['bf16_us']:8.1f} us ({r['bf16_tflops']:5.1f} TFLOP/s), FP8 cache "
            f"{r['fp8_us']:8.1f} us ({r['fp8_tflops']:5.1f}): {r['bf16_us'] / r['fp8_us']:.2f}x"
            + (
                f"; best tile {r['fp8_best_tile']} {r['fp8_best_us']:8.1f} us ({r['bf16_us'] / r['fp8_best_us']:.2f}x)"
                if "fp8_best_us" in r
                else ""
            )
        )
    names = [k[:-3] for k in res["decode"][0] if k.endswith("_us")] if res["decode"] else []
    print(f"{'batch':>5} {'ctx':>5} " + " ".join(f"{n:>16}" for n in names) + "   (us; FP8 / bf16 speedup)")
    for r in res["decode"]:
        cells = [
            f"{r.get(n + '_us', float('nan')):9.1f} {r['bf16_us'] / r.get(n + '_us', float('nan')):5.2f}x"
            for n in names
        ]
        print(f"{r['batch']:5d} {r['ctx']:5d} " + " ".join(f"{c:>16}" for c in cells))
    ok = all(c["ok"] for c in res["checks"])
    print("checks:", "skipped" if not res["checks"] else "all ok" if ok else "FAILED")


if __name__ == "__main__":
    main()
