"""The paper's kernel measurements on a GPU (its Fig. 18a and the kernel half of 18b): the paged attention kernel
against SDPA over a contiguous cache at the same decode shapes, and the paged kernel at every block size.

The shapes are the model's (query heads, KV heads, head dim; bf16) with decode batches whose contexts are drawn
from the paper's workload shapes: each sequence at a uniformly random point of its output (prompt + a fraction
of the output already generated), as a serving batch holds them. SDPA reads a contiguous cache padded to the
longest context, masked by length: what a system that reserves contiguous KV memory per request runs. The
paged kernel reads block-size-16 pages (and every block size of the sweep) through shuffled block tables.
Each run is checked against SDPA's output before it is timed; times are CUDA-graph replays
(`kernels.graph_ms`: no host time), medians.

    python benchmarks/paper_eval.py --model DIR --sections kernels --json benchmarks/results/paper-kernels.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from paper_workloads import fit_paper_shape

BATCHES = (8, 64, 256)
CHECK_TOL = 2e-2  # bf16 attention against bf16 SDPA (kernels.py's floor is 1e-2 per path)


def decode_contexts(name: str, batch: int, seed: int, max_len: int = 2048) -> list[int]:
    """Context lengths of a decode batch of the `name` shape: prompt plus a uniform share of the output."""
    rng = np.random.default_rng(seed)
    ins, outs = fit_paper_shape(name, max_len).sample(batch, rng)
    return [int(i + max(1, round(u * o))) for i, o, u in zip(ins, outs, rng.random(batch), strict=True)]


def sdpa_contiguous(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> Any:
    """SDPA of one decode token per sequence over a contiguous `[B, Hkv, L, D]` cache with a `[B, 1, 1, L]`
    additive length mask, as a closure returning `[B, Hq, D]`: the G query heads of a KV head are G query rows of it
    (query head h reads KV head h // G), so any SDPA backend takes it and the cache is read once per KV head."""
    b, hq, d = q.shape
    rows = q.view(b, k.shape[1], hq // k.shape[1], d)
    return lambda: F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scale).view(b, hq, d)


def paged_call(batch: tuple[torch.Tensor, ...], scale: float, max_len: int) -> Any:
    """The paged kernel on one decode batch (`kernels.paged_batch`'s tensors), as a closure to time."""
    import tinypaged.kernels as tk

    return lambda: tk.paged_attention(*batch, scale, max_query_len=1, max_seq_len=max_len)


def one_shape(
    heads: tuple[int, int, int], name: str, batch: int, block_sizes: list[int], seed: int
) -> dict[str, Any]:
    """Paged (block size 16 and the sweep) against contiguous SDPA on one decode batch."""
    import kernel_speed as kb  # its paged batches and graph timing

    from tinypaged import ops

    hq, hkv, d = heads
    ctx = decode_contexts(name, batch, seed)
    seq_lens_list = [c + 1 for c in ctx]
    max_len = max(seq_lens_list)
    scale = d**-0.5
    row: dict[str, Any] = {
        "workload": name,
        "batch": batch,
        "mean_ctx": float(np.mean(seq_lens_list)),
        "max_ctx": max_len,
        "kv_bytes": 2 * 2 * hkv * d * sum(seq_lens_list),
    }
    batch16 = kb.paged_batch([1] * batch, ctx, hq, hkv, d, 16, seed=seed)
    q, kv, bt, seq_lens, _ = batch16
    # The contiguous cache spans whole 16-token blocks (its rows stay 16-aligned, as SDPA's fused kernels want),
    # with an additive mask made once, in the query's dtype (SDPA converts a boolean one at every call).
    padded = bt.shape[1] * 16
    k, v = (t.transpose(1, 2).contiguous().to(q.dtype) for t in ops.gather_context(kv, bt, padded))
    valid = torch.arange(padded, device=q.device)[None, :] < seq_lens[:, None]
    mask = torch.zeros(valid.shape, dtype=q.dtype, device=q.device).masked_fill(~valid, float("-inf"))
    mask = mask[:, None, None, :]
    sdpa = sdpa_contiguous(q, k, v, mask, scale)
    want = sdpa()
    paged = paged_call(batch16, scale, max_len)
    row["rel_err_16"] = kb.rel_err(paged(), want)
    row["ms_paged_16"] = kb.graph_ms([paged])
    row["ms_sdpa_contiguous"] = kb.graph_ms([sdpa])
    del k, v, mask
    row["by_block_size"] = {}
    for bs in block_sizes:
        try:
            tensors = kb.paged_batch([1] * batch, ctx, hq, hkv, d, bs, seed=seed)
            fn = paged_call(tensors, scale, max_len)
            ref = ops.ref_paged_attention(*tensors, scale)
            entry = {"rel_err": kb.rel_err(fn(), ref), "ms": kb.graph_ms([fn])}
            entry["ok"] = entry["rel_err"] < CHECK_TOL
        except Exception as exc:  # a block size the kernel refuses: recorded, the sweep goes on
            entry = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        row["by_block_size"][str(bs)] = entry
        torch.cuda.empty_cache()
    row["ok"] = row["rel_err_16"] < CHECK_TOL and all(
        e.get("ok", False) for e in row["by_block_size"].values()
    )
    print(
        f"  {name} batch {batch} (ctx mean {row['mean_ctx']:.0f}, max {max_len}): "
        f"paged {1e3 * row['ms_paged_16']:.1f} us, "
        f"SDPA contiguous {1e3 * row['ms_sdpa_contiguous']:.1f} us, rel err {row['rel_err_16']:.1e}",
        flush=True,
    )
    return row


def run_kernels(model: str | Path | None, block_sizes: list[int], seed: int = 0) -> dict[str, Any]:
    """Every workload shape and batch of BATCHES at the model's attention shape (CUDA only)."""
    from tinypaged.config import ModelConfig
    from tinypaged.weights import default_model_dir

    if not torch.cuda.is_available():
        return {"error": "needs a CUDA GPU"}
    cfg = ModelConfig.from_dir(model or default_model_dir())
    heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    rows = [one_shape(heads, name, b, block_sizes, seed) for name in ("sharegpt", "alpaca") for b in BATCHES]
    return {"heads": heads, "block_sizes": block_sizes, "rows": rows, "all_ok": all(r["ok"] for r in rows)}


def kernel_table(res: dict[str, Any]) -> str:
    """Paged against contiguous SDPA, and the paged kernel's time at each block size (us)."""
    sizes = res["block_sizes"]
    lines = [
        f"kernels (heads {res['heads']}; checks {'all ok' if res['all_ok'] else 'FAILED: see JSON'})",
        "workload  batch  ctx mean/max   paged16 us   SDPA us   "
        + "".join(f"{'bs' + str(b):>8}" for b in sizes),
    ]
    for r in res["rows"]:
        by = r["by_block_size"]
        cells = "".join(
            f"{1e3 * by[str(b)]['ms']:>8.1f}" if "ms" in by[str(b)] else f"{'err':>8}" for b in sizes
        )
        lines.append(
            f"{r['workload']:<9} {r['batch']:>5}  {r['mean_ctx']:>6.0f}/{r['max_ctx']:<6} "
            f"{1e3 * r['ms_paged_16']:>10.1f}   {1e3 * r['ms_sdpa_contiguous']:>7.1f}   {cells}"
        )
    return "\n".join(lines)
