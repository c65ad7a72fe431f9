"""Short-query attention on the H200 (issue 39): a speculative verification's k + 1 = 5 new tokens of one
sequence, the 8B shape's heads (32 query, 8 KV, head dim 128, bf16, block size 16), through the prefill launch
(`short_query_len=1`: one program a KV head walks the context) against the split decode launch
(`short_query_len=5`), as CUDA-graph replays; each output checked against `ops.ref_paged_attention` first. Two
layouts: the sequence alone, and as a 16-token mixed-step graph holds it (256 sequence rows, 11 padding tokens).

    python benchmarks/short_query_attention.py --json benchmarks/results/short-query-attention-h200.json
"""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any

import torch
from fp8_gemm_sweep import graph_us

from tinypaged import ops
from tinypaged.kernels import attention

DEV, HEAD_DIM, HQ, HKV, BLOCK = "cuda", 128, 32, 8, 16
Q_LEN = 5


def layout(ctx: int, rows: int, tokens: int) -> tuple[torch.Tensor, ...]:
    """q `[tokens, HQ, D]`, a shuffled paged cache, and a batch of `rows` sequence rows: the first has ctx + Q_LEN
    tokens (Q_LEN new), the others none; tokens past Q_LEN belong to no sequence (a graph's padding)."""
    blocks = -(-(ctx + Q_LEN) // BLOCK)
    kv = torch.randn(2, blocks + 8, BLOCK, HKV, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    tables = torch.full((rows, blocks + 2), -1, dtype=torch.int32, device=DEV)
    tables[0, :blocks] = torch.randperm(blocks + 8, device=DEV)[:blocks].int()
    lens = torch.zeros(rows, dtype=torch.int32, device=DEV)
    lens[0] = ctx + Q_LEN
    starts = torch.full((rows + 1,), Q_LEN, dtype=torch.int32, device=DEV)
    starts[0] = 0
    q = torch.randn(tokens, HQ, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    return q, kv, tables, lens, starts


def measure() -> list[dict[str, Any]]:
    rows_out = []
    scale = HEAD_DIM**-0.5
    for name, rows, tokens in (("one sequence", 1, Q_LEN), ("mixed graph, 16 tokens, 256 rows", 256, 16)):
        for ctx in (512, 2048):
            q, kv, tables, lens, starts = layout(ctx, rows, tokens)
            ref = ops.ref_paged_attention(
                q[:Q_LEN].float(), kv.float(), tables[:1], lens[:1], starts[:2], scale
            )
            row: dict[str, Any] = {"case": name, "ctx": ctx}
            for short in (1, Q_LEN):
                out = torch.zeros_like(q)

                call = functools.partial(
                    attention.paged_attention, q, kv, tables, lens, starts, scale, max_query_len=tokens,
                    max_seq_len=ctx + BLOCK, out=out, short_query_len=short,
                )  # fmt: skip
                call()
                torch.cuda.synchronize()
                row[f"short{short}_err"] = ((out[:Q_LEN].float() - ref).norm() / ref.norm()).item()
                row[f"short{short}_us"] = graph_us(lambda i, call=call: call(), 16)
            rows_out.append(row)
            print(row, flush=True)
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    rows = measure()
    print(
        f"{'case':34s} {'ctx':>5s} {'prefill launch us':>18s} {'decode launch us':>17s} {'x':>6s}  rel err 1 / 5"
    )
    for r in rows:
        print(
            f"{r['case']:34s} {r['ctx']:5d} {r['short1_us']:18.1f} {r[f'short{Q_LEN}_us']:17.1f} "
            f"{r['short1_us'] / r[f'short{Q_LEN}_us']:6.2f}  {r['short1_err']:.1e} / {r[f'short{Q_LEN}_err']:.1e}"
        )
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
