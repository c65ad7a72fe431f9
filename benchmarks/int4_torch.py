"""torch's own CUDA INT4 kernel (`aten._weight_int4pack_mm`, the "tinygemm" kernel gpt-fast and torchao use)
against tinypaged's INT4 path (`lowbit.wint_linear`: the Gluon kernel up to 8 rows, the Triton kernel from 9) and
bf16, on the GPU (issue 38).

    python3 benchmarks/int4_torch.py --json benchmarks/results/int4-torch-h200.json [--decode /tmp/m8b]

The same codes go to both: tinypaged's round-to-nearest INT4 g128 with zero points (`lowbit.quantize_rtn`, the
engine's `quantization="int4"`), packed for torch by `_convert_weight_to_int4pack` (two codes a byte, then its
tiled layout; `--inner-k-tiles`), its scale and zero in bf16 (torch's weight is `(code - 8) * scale + zero`, so
zero = `(8 - zero point) * scale`; its kernel makes the weight in bf16 too: roundings tinypaged's float32 scales
do not make). Checks at each shape and row count: the relative error of each against the float32 product of the
exact weights, and torch's against the float32 product of its own bf16 scales and zeros. The layers are timed
as CUDA-graph replays, each launch on its own copy of the weight (past the L2). With `--decode`, batch-1 and
batch-16 decode (benchmarks/lowbit.py's measurements) of bf16, INT4 as the engine runs it, and INT4 with torch's
kernel at the row counts where it won (the first run of measured row counts where its four layers took under 97%
of tinypaged's, from the row after the measured count below it; `--torch-rows R`: 1 to R), through a stand-in
for `lowbit.wint_linear` that packs each layer for torch on its first call (outside graph capture) and keeps the
other rows on tinypaged's path. The table is printed last.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from common import write_json
from fp8_gemm_sweep import graph_us
from int4_mma import DEV, SHAPES, copies_for, nbytes, rel_err

from tinypaged import ops
from tinypaged.model.quant import lowbit

ROWS = (1, 2, 4, 8, 16)


def torch_pack(w: lowbit.IntWeight, inner_k_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An INT4 weight as `_weight_int4pack_mm` takes it: (packed codes, scales and zeros `[K / group, N, 2]` bf16)."""
    codes = lowbit.unpack(w.qweight, 4)  # [N, K], 0..15
    two = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8).contiguous()  # the even column high
    packed = torch.ops.aten._convert_weight_to_int4pack(two, inner_k_tiles)
    zero_point = 8.0 if w.zeros is None else w.zeros.float()
    scale = w.scales.to(torch.bfloat16)
    zero = ((8.0 - zero_point) * w.scales).to(torch.bfloat16)
    return packed, torch.stack([scale, zero], -1).contiguous()


def torch_weight(w: lowbit.IntWeight, sz: torch.Tensor) -> torch.Tensor:
    """The weight `[N, K]` in float32 as torch's kernel defines it, from its bf16 scales and zeros."""
    codes = lowbit.unpack(w.qweight, 4).float()
    scale, zero = (sz[..., i].float().t().repeat_interleave(w.group, 1) for i in (0, 1))
    return (codes - 8) * scale + zero


def torch_usable(x: torch.Tensor, w: lowbit.IntWeight, inner_k_tiles: int) -> bool:
    n, k = w.qweight.shape[0], x.shape[-1]
    return (
        w.bits == 4 and w.mins is None and w.cpu is None and x.is_cuda and x.dtype == torch.bfloat16
        and w.group in (32, 64, 128, 256) and k % (16 * inner_k_tiles) == 0 and n % 8 == 0
    )  # fmt: skip


def layers(res: dict[str, Any], gen: torch.Generator, tiles: list[int]) -> None:
    out = res.setdefault("layers", [])
    for name, n, k in SHAPES:
        wb = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=gen) / k**0.5
        w = lowbit.quantize_rtn(wb, 4, 128, False)
        ws = [w] + [
            w._replace(qweight=w.qweight.clone(), scales=w.scales.clone(), zeros=w.zeros.clone())
            for _ in range(copies_for(nbytes(w)) - 1)
        ]
        bs = [wb] + [wb.clone() for _ in range(copies_for(2 * n * k) - 1)]
        packs = {t: [torch_pack(v, t) for v in ws] for t in tiles}
        exact = lowbit.dequantize_weight(w)
        own = torch_weight(w, packs[tiles[0]][0][1])
        for m in ROWS:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
            want = x.float() @ exact.T
            row: dict[str, Any] = {"layer": name, "n": n, "k": k, "m": m, "int4_bytes": nbytes(w)}
            row["ours_err"] = rel_err(lowbit.wint_linear(x, w), want)
            row["bf16_us"] = graph_us(lambda i, x=x, bs=bs: ops.linear(x, bs[i]), len(bs))
            row["ours_us"] = graph_us(lambda i, x=x, ws=ws: lowbit.wint_linear(x, ws[i]), len(ws))
            for t, ps in packs.items():
                y = torch.ops.aten._weight_int4pack_mm(x, ps[0][0], w.group, ps[0][1])
                row[f"torch{t}_err"] = rel_err(y, want)
                row[f"torch{t}_err_own"] = rel_err(y, x.float() @ own.T)
                row[f"torch{t}_us"] = graph_us(
                    lambda i, x=x, ps=ps, g=w.group: torch.ops.aten._weight_int4pack_mm(
                        x, ps[i][0], g, ps[i][1]
                    ),
                    len(ps),
                )
            out.append(row)
            print({a: round(b, 4) if isinstance(b, float) else b for a, b in row.items()}, flush=True)
        del ws, bs, packs
        torch.cuda.empty_cache()


def fours(res: dict[str, Any], key: str, m: int) -> float:
    rows = [r for r in res["layers"] if r["m"] == m]
    return sum(r.get(key, math.nan) for r in rows) if len(rows) == len(SHAPES) else math.nan


def decode(
    res: dict[str, Any], model: str, rows: tuple[int, int], inner_k_tiles: int, passes: int, path: str
) -> None:
    """bf16, INT4 as the engine runs it, INT4 with torch's kernel at `rows` (first, last); `passes` times each."""
    from common import free_llm, run_latency
    from lowbit import run_batch

    from tinypaged import LLM

    plain = lowbit.wint_linear
    packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def with_torch(x: torch.Tensor, w: lowbit.IntWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if rows[0] <= x2.shape[0] <= rows[1] and torch_usable(x2, w, inner_k_tiles):
            p = packed.get(w.qweight.data_ptr())
            if p is None and not torch.cuda.is_current_stream_capturing():
                p = packed[w.qweight.data_ptr()] = torch_pack(w, inner_k_tiles)
            if p is not None:
                y = torch.ops.aten._weight_int4pack_mm(x2.contiguous(), p[0], w.group, p[1])
                return (y if bias is None else y + bias).reshape(*x.shape[:-1], -1)
        return plain(x, w, bias)

    out = res.setdefault("decode", {})
    for p in range(passes):
        for name in ("bf16", "int4", "int4-torch"):
            lowbit.wint_linear = with_torch if name == "int4-torch" else plain
            packed.clear()
            try:
                llm = LLM(
                    model=model,
                    max_model_len=2048,
                    max_num_seqs=64,
                    **({} if name == "bf16" else {"quantization": "int4"}),
                )
                lat = run_latency(llm, modes=("graphs",))
                b16 = run_batch(llm)
                b16.pop("tokens", None)
                out.setdefault(name, []).append(
                    {"batch1": lat["graphs"]["decode_tokens_per_s"], "batch16": b16["decode_tokens_per_s"],
                     "torch_packed_layers": len(packed)}
                )  # fmt: skip
                free_llm(llm)
            finally:
                lowbit.wint_linear = plain
            print(f"pass {p} {name}: {out[name][-1]}", flush=True)
            write_json(path, res)  # an engine at a time: a cut run keeps what it measured


def table(res: dict[str, Any], tiles: list[int]) -> None:
    print(
        "\n| rows | bf16 four layers (us) | tinypaged INT4 | "
        + " | ".join(f"torch k-tiles {t}" for t in tiles)
        + " |"
    )
    print("|---" * (3 + len(tiles)) + "|")
    for m in ROWS:
        cells = [fours(res, "bf16_us", m), fours(res, "ours_us", m)] + [
            fours(res, f"torch{t}_us", m) for t in tiles
        ]
        print(f"| {m} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    errs = res["layers"]
    print(
        f"relative error against the exact product: tinypaged {max(r['ours_err'] for r in errs):.2e}, torch "
        + ", ".join(f"{max(r[f'torch{t}_err'] for r in errs):.2e}" for t in tiles)
        + f" (against its own bf16 scales: {max(r[f'torch{tiles[0]}_err_own'] for r in errs):.2e})"
    )
    dec = res.get("decode")
    if dec:
        print("\n| engine | batch 1 tok/s | x bf16 | batch 16 tok/s | x bf16 |\n|---|---|---|---|---|")
        for name, runs in dec.items():
            for i, r in enumerate(runs):
                b = dec["bf16"][i]
                print(f"| {name} (pass {i}) | {r['batch1']:.1f} | {r['batch1'] / b['batch1']:.3f} | "
                      f"{r['batch16']:.1f} | {r['batch16'] / b['batch16']:.3f} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="benchmarks/results/int4-torch.json")
    ap.add_argument("--inner-k-tiles", type=int, nargs="+", default=[8, 4, 2])
    ap.add_argument("--decode", metavar="MODEL", help="also time the engines on this model")
    ap.add_argument("--torch-rows", type=int, help="torch's kernel at 1 to this many rows in the engine")
    ap.add_argument("--passes", type=int, default=1)
    args = ap.parse_args()
    res: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    print(res, flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    layers(res, gen, args.inner_k_tiles)
    tiles = args.inner_k_tiles
    best = min(tiles, key=lambda t: fours(res, f"torch{t}_us", 1))
    rows = (1, args.torch_rows) if args.torch_rows else (0, 0)
    wins = [
        i for i, m in enumerate(ROWS) if fours(res, f"torch{best}_us", m) < 0.97 * fours(res, "ours_us", m)
    ]
    if args.torch_rows is None and wins:  # the first run of row counts where torch's kernel wins
        last = wins[0]
        while last + 1 in wins:
            last += 1
        rows = (ROWS[wins[0] - 1] + 1 if wins[0] else 1, ROWS[last])
    res["torch_rows"], res["inner_k_tiles"] = rows, best
    write_json(args.json, res)
    if args.decode and rows[1]:
        decode(res, args.decode, rows, best, args.passes, args.json)
    table(res, tiles)


if __name__ == "__main__":
    main()
