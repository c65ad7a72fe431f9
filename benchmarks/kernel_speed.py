"""Check and time every Triton kernel on the GPU in one run, beside torch SDPA and the copy bandwidth.

    python3 benchmarks/kernel_speed.py [--out DIR] [--quick] [--sections SECTION ...]

Correctness at real shapes (bf16) against the torch references and SDPA, CUDA-graph capture of decode,
then decode attention bandwidth (KV bytes read / time), prefill attention TFLOP/s, and RMSNorm / SwiGLU /
rotary / KV write / block copy bandwidth as fractions of the device-to-device copy bandwidth measured in the
same run, the decode-step GEMV against torch's linear at the 8B shape's layers (weight bytes over time), and a
decode step's linear layers through torch (cuBLAS) at 8-256 rows against their roofline, one layer's
attention in a W1 step with prefill chunks (`--sections mixed_attention`), and two ways to cut a decode step:
the residual add in cuBLAS's epilogue (`residual`) and a layer's attention block by KV-head groups on streams
(`overlap`).
Times are medians of `triton.testing.do_bench` (which clears the L2 between calls). Prints a table last and
writes JSON.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from common import MATMUL_TFLOPS, make_workload, write_json
from triton.testing import do_bench

import tinypaged.kernels as tk
from tinypaged import ops

ROOT = Path(__file__).resolve().parents[1]
AttnConfig = tk.attention.AttnConfig
DEV = "cuda"
DT = torch.bfloat16
RESULTS: dict[str, Any] = {
    "checks": [],
    "decode": [],
    "decode_ragged": [],
    "prefill": [],
    "mixed_attention": [],
    "small": [],
    "gemv": [],
    "matmul": [],
    "residual": [],
    "overlap": [],
    "sweeps": [],
}
SECTIONS = (
    "correctness",
    "decode",
    "decode_ragged",
    "prefill",
    "mixed_attention",
    "small",
    "gemv",
    "matmul",
    "residual",
    "overlap",
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bench(fn: Any) -> float:
    """Median milliseconds of fn (warm-up first; L2 cleared before each timed call)."""
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def capture(fns: list[Any]) -> torch.cuda.CUDAGraph:
    """fns back to back in one CUDA graph (run once on a side stream first, as capture needs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return graph


def graph_ms(fns: list[Any], replays: int = 15) -> float:
    """Median milliseconds per call of fns captured back to back in one CUDA graph (no host time in it)."""
    graph = capture(fns)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2] / len(fns)


def check(name: str, err: float, tol: float) -> None:
    """Record (and print) one correctness check."""
    ok = err < tol and not math.isnan(err)
    RESULTS["checks"].append({"name": name, "rel_err": err, "tol": tol, "ok": ok})
    print(f"check {name:58s} rel_err {err:.2e} (tol {tol:.0e}) {'ok' if ok else 'FAIL'}", flush=True)


def paged_batch(
    q_lens: list[int], ctx_lens: list[int], hq: int, hkv: int, d: int, block_size: int, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """q and a paged cache with shuffled block tables (padded with -1) for the given ragged batch."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    nblk = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblk) + 8
    kv = torch.randn(2, num_blocks, block_size, hkv, d, device=DEV, dtype=DT, generator=gen)
    perm = torch.randperm(num_blocks, device=DEV, generator=gen)
    bt = torch.full((len(q_lens), max(nblk)), -1, dtype=torch.int32, device=DEV)
    used = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[used : used + n]
        used += n
    q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=DT, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return q, kv, bt, torch.tensor(seq_lens, dtype=torch.int32, device=DEV), qsl


def sdpa_per_seq(q, kv, bt, seq_lens, qsl, scale) -> torch.Tensor:
    """bf16 SDPA on each sequence's gathered (contiguous) K/V: the error floor of bf16 attention."""
    out = torch.empty_like(q)
    starts, lens = qsl.tolist(), seq_lens.tolist()
    for i, length in enumerate(lens):
        k, v = ops.gather_context(kv, bt[i : i + 1], length)
        n = starts[i + 1] - starts[i]
        qpos = torch.arange(length - n, length, device=DEV)
        mask = torch.arange(length, device=DEV)[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(
            q[starts[i] : starts[i + 1]].transpose(0, 1)[None],
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[starts[i] : starts[i + 1]] = o[0].transpose(0, 1)
    return out


def correctness() -> None:
    """Kernels against the references at real shapes, bf16; CUDA-graph capture of a decode step."""
    for hq, hkv, d in [(32, 8, 128), (9, 3, 64)]:
        for block_size in (8, 16, 32):
            q_lens = [1, 1, 1, 1, 1, 1, 700, 700, 256]
            ctx = [1, 15, 333, 1024, 2047, 2999, 0, 1200, 2000]
            batch = paged_batch(q_lens, ctx, hq, hkv, d, block_size, seed=block_size)
            scale = d**-0.5
            ref = ops.ref_paged_attention(*batch, scale)
            out = tk.paged_attention(*batch, scale)
            check(f"attn mixed {hq}/{hkv}/{d} bs{block_size} kernel vs ref", rel_err(out, ref), 1e-2)
            if block_size == 16:
                err = rel_err(sdpa_per_seq(*batch, scale), ref)
                check(f"attn mixed {hq}/{hkv}/{d} bs16 sdpa-bf16 vs ref", err, 1e-2)
                for splits in (1, 3, 16):
                    dq, dkv, dbt, dsl, dqsl = paged_batch([1] * 6, ctx[:6], hq, hkv, d, 16, seed=splits)
                    o = tk.paged_attention(dq, dkv, dbt, dsl, dqsl, scale, num_kv_splits=splits)
                    check(
                        f"attn decode {hq}/{hkv}/{d} splits {splits}",
                        rel_err(o, ops.ref_paged_attention(dq, dkv, dbt, dsl, dqsl, scale)),
                        1e-2,
                    )

    # Sliding windows (Mistral v0.1's 4096 scaled down; Gemma 3's 1024 with its head_dim of 256): the blocks
    # wholly below each sequence's window are -1 in its table, as the block manager leaves them (never read).
    for hq, hkv, d, window in [(32, 8, 128, 700), (8, 4, 256, 1024)]:
        q_lens = [1, 1, 1, 1, 700, 700, 256]
        ctx = [15, 1024, 2047, 2999, 0, 1200, 2000]
        batch = paged_batch(q_lens, ctx, hq, hkv, d, 16, seed=window)
        for i, c in enumerate(ctx):
            batch[2][i, : max(c - window + 1, 0) // 16] = -1
        scale = d**-0.5
        ref = ops.ref_paged_attention(*batch, scale, window=window)
        for splits in (None, 1, 4):
            out = tk.paged_attention(*batch, scale, window=window, num_kv_splits=splits)
            check(f"attn window {window} {hq}/{hkv}/{d} splits {splits} vs ref", rel_err(out, ref), 1e-2)

    # Decode inside a CUDA graph: hints given, no host sync; replay after the lengths change.
    ctx = [100, 900, 3000, 7, 64, 2000, 511, 4000]
    q, kv, bt, sl, qsl = paged_batch([1] * 8, ctx, 32, 8, 128, 16, seed=1)
    out = torch.empty_like(q)
    kwargs = dict(max_query_len=1, max_seq_len=bt.shape[1] * 16, out=out)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tk.paged_attention(q, kv, bt, sl, qsl, 0.088, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.paged_attention(q, kv, bt, sl, qsl, 0.088, **kwargs)
    sl.copy_(torch.tensor([50, 901, 2500, 8, 1, 1999, 512, 3999], dtype=torch.int32))  # within the tables
    graph.replay()
    torch.cuda.synchronize()
    check(
        "attn decode in a CUDA graph, lengths changed",
        rel_err(out, ops.ref_paged_attention(q, kv, bt, sl, qsl, 0.088)),
        1e-2,
    )

    # The small kernels, bf16.
    x, r = (torch.randn(37, 4096, device=DEV, dtype=DT) for _ in range(2))
    w = torch.randn(4096, device=DEV, dtype=DT)
    (o, s), (ro, rs) = tk.rms_norm(x, w, 1e-5, r), ops.ref_rms_norm(x, w, 1e-5, r)
    check("rms_norm + residual", max(rel_err(o, ro), rel_err(s, rs)), 1e-2)
    gate_up = torch.randn(37, 2 * 14336, device=DEV, dtype=DT)
    check("silu_and_mul", rel_err(tk.silu_and_mul(gate_up), ops.ref_silu_and_mul(gate_up)), 1e-2)
    positions = torch.randint(0, 8192, (37,), device=DEV)
    inv = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, device=DEV).float() / 128)
    ang = torch.arange(8192, device=DEV).float()[:, None] * inv
    cache = torch.cat((ang.cos(), ang.sin()), -1)
    qr, kr = torch.randn(37, 32, 128, device=DEV, dtype=DT), torch.randn(37, 8, 128, device=DEV, dtype=DT)
    a, b = tk.rotary_embedding(positions, qr, kr, cache)
    ra, rb = ops.ref_rotary_embedding(positions, qr, kr, cache)
    check("rotary", max(rel_err(a, ra), rel_err(b, rb)), 1e-2)
    kvl = torch.randn(2, 64, 16, 8, 128, device=DEV, dtype=DT)
    slots = torch.randperm(64 * 16, device=DEV)[:37]
    slots[::5] = -1
    key, value = torch.randn(2, 37, 8, 128, device=DEV, dtype=DT)
    expected = kvl.clone()
    ops.ref_write_kv(key, value, expected, slots)
    tk.write_kv(key, value, kvl, slots)
    check("write_kv", rel_err(kvl, expected), 1e-6)
    kvc = torch.randn(4, 2, 64, 16, 8, 128, device=DEV, dtype=DT)
    mapping = torch.tensor([[1, 40], [7, 41], [1, 63], [30, 2]], device=DEV)
    expected = kvc.clone()
    ops.ref_copy_blocks(expected, mapping)
    tk.copy_blocks(kvc, mapping)
    check("copy_blocks", rel_err(kvc, expected), 1e-6)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written) over a 2 GiB buffer."""
    src = torch.randn(2**29, device=DEV)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    bw = 2 * src.numel() * 4 / (ms * 1e-3)
    RESULTS["copy"] = {"bytes": 2 * src.numel() * 4, "ms": ms, "TBps": bw / 1e12}
    print(f"copy {bw / 1e12:.2f} TB/s", flush=True)
    return bw


DECODE_CONFIGS = [
    AttnConfig(16, 64, 4, 3, 128),
    AttnConfig(16, 64, 4, 2, 128),
    AttnConfig(16, 64, 4, 3),
    AttnConfig(16, 64, 4, 4, 128),
    AttnConfig(16, 32, 4, 4, 128),
    AttnConfig(16, 128, 4, 3),
    AttnConfig(16, 128, 8, 2),
]


def decode(copy_bw: float, quick: bool) -> None:
    """Decode attention bandwidth at the target shapes, beside SDPA on a contiguous cache."""
    for batch, ctx in [(64, 4096), (256, 1024), (8, 32768), (1, 8192)]:
        decode_shape(batch, ctx, copy_bw, quick)
        torch.cuda.empty_cache()


def decode_shape(batch: int, ctx: int, copy_bw: float, quick: bool) -> None:
    """One decode shape: a config sweep, the default config, SDPA; 32/8/128 heads, bf16, block size 16.

    Timed as CUDA-graph replays (as the engine runs decode) over enough distinct caches to exceed the L2
    several times; the default config is also timed eagerly with do_bench (host launch cost included when
    it exceeds the GPU time)."""
    hq, hkv, d, block_size = 32, 8, 128, 16
    g = hq // hkv
    kv_bytes = batch * ctx * hkv * d * 2 * 2
    n_sets = max(1, -(-256 * 2**20 // kv_bytes))
    sets = [
        paged_batch([1] * batch, [ctx - 1] * batch, hq, hkv, d, block_size, seed=i) for i in range(n_sets)
    ]
    scale = d**-0.5
    q0 = sets[0][0]
    default_cfg = tk.attention.default_configs(q0, g)
    auto = tk.attention.choose_num_splits(q0, batch, hkv, ctx, default_cfg[0].block_n)

    def ours(s: tuple[torch.Tensor, ...], cfg: Any = None, splits: int | None = None) -> Any:
        configs = None if cfg is None else (cfg, default_cfg[1])
        return lambda: tk.paged_attention(
            *s, scale, max_query_len=1, max_seq_len=ctx, num_kv_splits=splits, configs=configs
        )

    best = (float("inf"), None, None)
    sweep = [(c, s) for c in DECODE_CONFIGS for s in sorted({1, max(1, auto // 2), auto, auto * 2})]
    for cfg, splits in [] if quick else sweep:
        entry = {"kind": "decode", "shape": [batch, ctx], "cfg": repr(cfg), "splits": splits}
        try:
            ms = graph_ms([ours(s, cfg, splits) for s in sets])
        except Exception as exc:  # a config that does not compile or fit: record it and go on
            RESULTS["sweeps"].append({**entry, "error": str(exc)[:200]})
            continue
        RESULTS["sweeps"].append({**entry, "ms": ms, "TBps": kv_bytes / ms / 1e9})
        if ms < best[0]:
            best = (ms, cfg, splits)
    ms_default = graph_ms([ours(s) for s in sets])
    ms_eager = bench(ours(sets[0]))
    if best[1] is None:
        best = (ms_default, default_cfg[0], auto)
    # SDPA on a contiguous cache [B, Hkv, L, D]: GQA as G query rows per KV head, and with enable_gqa.
    caches = [
        (
            s[0],
            torch.randn(batch, hkv, ctx, d, device=DEV, dtype=DT),
            torch.randn(batch, hkv, ctx, d, device=DEV, dtype=DT),
        )
        for s in sets
    ]
    sdpa = F.scaled_dot_product_attention
    ms_sdpa_rows = graph_ms(
        [lambda c=c: sdpa(c[0].view(batch, hkv, g, d), c[1], c[2], scale=scale) for c in caches]
    )
    ms_sdpa_gqa = graph_ms(
        [
            lambda c=c: sdpa(c[0].view(batch, hq, 1, d), c[1], c[2], scale=scale, enable_gqa=True)
            for c in caches
        ]
    )
    ms_sdpa = min(ms_sdpa_rows, ms_sdpa_gqa)
    row = {
        "batch": batch,
        "ctx": ctx,
        "kv_bytes": kv_bytes,
        "input_sets": n_sets,
        "splits_auto": auto,
        "ms_default": ms_default,
        "TBps_default": kv_bytes / ms_default / 1e9,
        "ms_default_eager": ms_eager,
        "ms_best": best[0],
        "best_cfg": repr(best[1]),
        "best_splits": best[2],
        "TBps_best": kv_bytes / best[0] / 1e9,
        "ms_sdpa_rows": ms_sdpa_rows,
        "ms_sdpa_gqa": ms_sdpa_gqa,
        "TBps_sdpa": kv_bytes / ms_sdpa / 1e9,
        "frac_copy_default": kv_bytes / ms_default / 1e-3 / copy_bw,
        "frac_copy_sdpa": kv_bytes / ms_sdpa / 1e-3 / copy_bw,
    }
    RESULTS["decode"].append(row)
    print(
        f"decode {batch}x{ctx}: default {row['TBps_default']:.2f} TB/s (splits {auto}), best "
        f"{row['TBps_best']:.2f} ({row['best_cfg']}, splits {best[2]}), sdpa {row['TBps_sdpa']:.2f}",
        flush=True,
    )
    if batch == 64:  # host time of one eager call (what CUDA graphs remove)
        fn = ours(sets[0])
        n = 200
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        RESULTS["decode_host_us_per_call"] = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()


def decode_ragged(copy_bw: float, max_seq_len: int = 2048) -> None:
    """Decode attention over W1-like ragged contexts (uniform in [96, 1536]) as the engine's decode graphs launch
    it: the split count chosen for `max_seq_len` (a graph's bound is max_model_len, whatever the contexts), beside
    fixed split counts, each with the programs in batch order and longest first (`seq_order`, as the engine
    stages it). In batch order the longest sequences' programs can be left running alone at the end."""
    hq, hkv, d, block_size = 32, 8, 128, 16
    scale = d**-0.5
    for batch in (256, 200, 128, 64, 32):
        rng = torch.Generator().manual_seed(batch)
        ctx = torch.randint(96, 1537, (batch,), generator=rng).tolist()
        kv_bytes = sum(c + 1 for c in ctx) * hkv * d * 2 * 2
        n_sets = max(1, -(-256 * 2**20 // kv_bytes))
        sets = [paged_batch([1] * batch, ctx, hq, hkv, d, block_size, seed=i) for i in range(n_sets)]
        q0 = sets[0][0]
        order = torch.argsort(sets[0][3], descending=True, stable=True).to(torch.int32)
        block_n = tk.attention.default_configs(q0, hq // hkv)[0].block_n
        auto = tk.attention.choose_num_splits(q0, batch, hkv, max_seq_len, block_n)
        row: dict[str, Any] = {
            "batch": batch,
            "ctx_mean": sum(ctx) / batch,
            "kv_bytes": kv_bytes,
            "splits_auto": auto,
        }
        for name, seq_order in (("batch_order", None), ("longest_first", order)):
            for splits in sorted({1, 2, 4, 8, auto}):
                ms = graph_ms(
                    [
                        lambda s=s, k=splits, o=seq_order: tk.paged_attention(
                            *s, scale, max_query_len=1, max_seq_len=max_seq_len, num_kv_splits=k, seq_order=o
                        )
                        for s in sets
                    ]
                )
                row[f"TBps_{name}_splits_{splits}"] = kv_bytes / ms / 1e9
                row[f"frac_copy_{name}_splits_{splits}"] = kv_bytes / ms / 1e-3 / copy_bw
            print(
                f"decode ragged {batch} x ~{row['ctx_mean']:.0f}, {name}: auto splits {auto}; TB/s by splits "
                + ", ".join(
                    f"{k.rsplit('_', 1)[1]}: {v:.2f}" for k, v in row.items() if k.startswith(f"TBps_{name}")
                ),
                flush=True,
            )
        RESULTS["decode_ragged"].append(row)
        torch.cuda.empty_cache()


PREFILL_CONFIGS = [
    AttnConfig(128, 32, 4, 4),
    AttnConfig(128, 64, 4, 4),
    AttnConfig(128, 64, 4, 5),
    AttnConfig(128, 128, 8, 3),
    AttnConfig(256, 64, 8, 3),
    AttnConfig(256, 64, 8, 4),
    AttnConfig(256, 128, 8, 3),
    AttnConfig(256, 32, 8, 3),
]


def prefill(quick: bool) -> None:
    """Causal prefill attention TFLOP/s (4 x 2048 new tokens, and 4 x 512 after 1536 cached), beside SDPA."""
    for batch, new, ctx, heads in [
        (4, 2048, 0, (32, 8, 128)),
        (4, 512, 1536, (32, 8, 128)),
        (4, 2048, 0, (9, 3, 64)),
    ]:
        prefill_shape(batch, new, ctx, heads, quick)
        torch.cuda.empty_cache()


def prefill_shape(batch: int, new: int, ctx: int, heads: tuple[int, int, int], quick: bool) -> None:
    """One prefill shape: a config sweep, the default config, SDPA; bf16, block size 16."""
    hq, hkv, d = heads
    block_size = 16
    g = hq // hkv
    q, kv, bt, sl, qsl = paged_batch([new] * batch, [ctx] * batch, hq, hkv, d, block_size, seed=new)
    scale = d**-0.5
    flops = 4 * d * hq * batch * sum(ctx + i + 1 for i in range(new))
    default_cfg = tk.attention.default_configs(q, g)

    def ours(cfg: Any = None) -> torch.Tensor:
        configs = None if cfg is None else (default_cfg[0], cfg)
        return tk.paged_attention(
            q, kv, bt, sl, qsl, scale, max_query_len=new, max_seq_len=ctx + new, configs=configs
        )

    best = (float("inf"), None)
    for cfg in [] if quick else PREFILL_CONFIGS:
        entry = {"kind": "prefill", "shape": [batch, new, ctx, *heads], "cfg": repr(cfg)}
        try:
            ms = bench(lambda cfg=cfg: ours(cfg))
        except Exception as exc:
            RESULTS["sweeps"].append({**entry, "error": str(exc)[:200]})
            continue
        RESULTS["sweeps"].append({**entry, "ms": ms, "TFLOPs": flops / ms / 1e9})
        if ms < best[0]:
            best = (ms, cfg)
    ms_default = bench(ours)
    if best[1] is None:
        best = (ms_default, default_cfg[1])
    qs = q.view(batch, new, hq, d).transpose(1, 2)
    kc = torch.randn(batch, hkv, ctx + new, d, device=DEV, dtype=DT)
    vc = torch.randn_like(kc)
    ke, ve = kc.repeat_interleave(g, 1), vc.repeat_interleave(g, 1)
    if ctx == 0:
        mask_kw: dict[str, Any] = {"is_causal": True}
    else:  # bottom-right causal mask, explicit (SDPA's is_causal is top-left)
        qpos = torch.arange(ctx, ctx + new, device=DEV)
        mask_kw = {"attn_mask": torch.arange(ctx + new, device=DEV)[None, :] <= qpos[:, None]}
    sdpa = F.scaled_dot_product_attention
    ms_gqa = bench(lambda: sdpa(qs, kc, vc, scale=scale, enable_gqa=True, **mask_kw))
    ms_exp = bench(lambda: sdpa(qs, ke, ve, scale=scale, **mask_kw))
    ms_sdpa = min(ms_gqa, ms_exp)
    row = {
        "batch": batch,
        "new": new,
        "ctx": ctx,
        "heads": heads,
        "flops": flops,
        "ms_default": ms_default,
        "TFLOPs_default": flops / ms_default / 1e9,
        "ms_best": best[0],
        "best_cfg": repr(best[1]),
        "TFLOPs_best": flops / best[0] / 1e9,
        "ms_sdpa_gqa": ms_gqa,
        "ms_sdpa_expanded": ms_exp,
        "TFLOPs_sdpa": flops / ms_sdpa / 1e9,
        "frac_sdpa_default": ms_sdpa / ms_default,
    }
    RESULTS["prefill"].append(row)
    print(
        f"prefill {batch}x{new} ctx {ctx} heads {heads}: default {row['TFLOPs_default']:.0f} TFLOP/s, best "
        f"{row['TFLOPs_best']:.0f} ({row['best_cfg']}), sdpa {row['TFLOPs_sdpa']:.0f}",
        flush=True,
    )


def mixed_attention(quick: bool) -> None:
    """One layer's attention in a W1 step with prefill chunks: the first W1 (seed 2) prompts that fit in 8,000
    tokens, fresh, alone and beside 137 decodes at 100-1,100 tokens of context (the decodes alone too), in CUDA
    graphs; the prefill part with each swept config as well. W1's chunks are short and causal, unlike 4 x 2048."""
    chunk: list[int] = []
    for prompt, _ in make_workload(256, 128256, seed=2):
        if sum(chunk) + len(prompt) > 8000:
            break
        chunk.append(len(prompt))
    dec_ctx = torch.randint(100, 1101, (137,), generator=torch.Generator().manual_seed(0)).tolist()
    mixed_attention_case("prefill", chunk, [0] * len(chunk), quick)
    mixed_attention_case("prefill_and_decodes", chunk + [1] * 137, [0] * len(chunk) + dec_ctx, quick)
    mixed_attention_case("decodes", [1] * 137, dec_ctx, quick)


def mixed_attention_case(name: str, q_lens: list[int], ctx: list[int], quick: bool) -> None:
    """One case of `mixed_attention`: the default configs (decodes longest first, as the engine stages them)."""
    hq, hkv, d, block_size = 32, 8, 128, 16
    q, kv, bt, sl, qsl = paged_batch(q_lens, ctx, hq, hkv, d, block_size, seed=1)
    pairs = list(zip(q_lens, ctx, strict=True))
    flops = sum(4 * d * hq * sum(c + i + 1 for i in range(n)) for n, c in pairs if n > 1)
    kv_bytes = sum(c + 1 for n, c in pairs if n == 1) * hkv * d * 2 * 2
    order = torch.argsort(sl, descending=True, stable=True).to(torch.int32)
    decode_cfg = tk.attention.default_configs(q, hq // hkv)[0]

    def ours(cfg: Any = None) -> torch.Tensor:
        return tk.paged_attention(
            q,
            kv,
            bt,
            sl,
            qsl,
            d**-0.5,
            max_query_len=max(q_lens),
            max_seq_len=2048,
            configs=None if cfg is None else (decode_cfg, cfg),
            seq_order=order,
        )

    us = 1e3 * graph_ms([ours] * 4)
    row: dict[str, Any] = {
        "case": name,
        "prompt_lens": [n for n in q_lens if n > 1],
        "decodes": q_lens.count(1),
        "prefill_flops": flops,
        "decode_kv_bytes": kv_bytes,
        "us_default": us,
        "prefill_TFLOPs_if_alone": flops / us / 1e6 if flops else None,
        "sweep_us": {},
    }
    for cfg in [] if quick or not flops else PREFILL_CONFIGS:
        row["sweep_us"][repr(cfg)] = 1e3 * graph_ms([lambda cfg=cfg: ours(cfg)] * 4)
    RESULTS["mixed_attention"].append(row)
    best = min(row["sweep_us"].values(), default=us)
    print(
        f"mixed attention, {name}: {sum(q_lens)} tokens, {flops / 1e12:.3f} TFLOP, decode K/V "
        f"{kv_bytes / 1e9:.2f} GB: {us:.0f} us a layer (best swept config {best:.0f} us)",
        flush=True,
    )


def small(copy_bw: float) -> None:
    """RMSNorm, SwiGLU, rotary, KV write (alone and fused with the rotary) and block copy: bytes they must move
    over time, against copy bandwidth."""
    t, h = 8192, 4096
    x, r = (torch.randn(t, h, device=DEV, dtype=DT) for _ in range(2))
    w = torch.randn(h, device=DEV, dtype=DT)
    rows = [
        ("rms_norm 8192x4096", 2 * t * h * 2, lambda: tk.rms_norm(x, w, 1e-5)),
        ("rms_norm+residual 8192x4096", 4 * t * h * 2, lambda: tk.rms_norm(x, w, 1e-5, r)),
        ("torch rms_norm+residual (ref)", 4 * t * h * 2, lambda: ops.ref_rms_norm(x, w, 1e-5, r)),
    ]
    inter = 14336  # Llama-3.1-8B; reads gate and up [T, 2 * I], writes [T, I]
    gate_up = torch.randn(t, 2 * inter, device=DEV, dtype=DT)
    rows += [
        ("silu_and_mul 8192x14336", 3 * t * inter * 2, lambda: tk.silu_and_mul(gate_up)),
        ("torch silu_and_mul (ref)", 3 * t * inter * 2, lambda: ops.ref_silu_and_mul(gate_up)),
    ]
    positions = torch.randint(0, 8192, (t,), device=DEV)
    cache = torch.randn(8192, 128, device=DEV)
    q, k = torch.randn(t, 32, 128, device=DEV, dtype=DT), torch.randn(t, 8, 128, device=DEV, dtype=DT)
    rot_bytes = 2 * (q.numel() + k.numel()) * 2 + t * 128 * 4
    rows.append(("rotary 8192 tok 32/8/128", rot_bytes, lambda: tk.rotary_embedding(positions, q, k, cache)))
    kvl = torch.randn(2, 4096, 16, 8, 128, device=DEV, dtype=DT)
    slots = torch.randperm(4096 * 16, device=DEV)[:t]
    rows.append(("write_kv 8192 tok 8/128", 2 * k.numel() * 2 * 2, lambda: tk.write_kv(k, k, kvl, slots)))
    # Fused: q read and written, k and v read and written into the cache, the cos/sin rows read.
    fused_bytes = 2 * q.numel() * 2 + 2 * 2 * k.numel() * 2 + t * 128 * 4
    rows.append(
        (
            "rotary + write_kv fused, 8192 tok 32/8/128",
            fused_bytes,
            lambda: tk.rotary_write_kv(positions, q, k, k, cache, kvl, slots),
        )
    )
    rows.append(
        (
            "rotary then write_kv (two launches)",
            fused_bytes,
            lambda: tk.write_kv(tk.rotary_embedding(positions, q, k, cache)[1], k, kvl, slots),
        )
    )
    kvc = torch.randn(32, 2, 512, 16, 8, 128, device=DEV, dtype=DT)
    mapping = torch.stack((torch.arange(0, 128, 2), torch.arange(1, 128, 2)), 1).to(DEV)
    cb_bytes = 2 * 32 * 2 * mapping.shape[0] * 16 * 8 * 128 * 2
    rows.append(("copy_blocks 64 pairs x 32 layers", cb_bytes, lambda: tk.copy_blocks(kvc, mapping)))
    for name, nbytes, fn in rows:
        ms = bench(fn)
        RESULTS["small"].append(
            {
                "name": name,
                "bytes": nbytes,
                "ms": ms,
                "TBps": nbytes / ms / 1e9,
                "frac_copy": nbytes / ms / 1e-3 / copy_bw,
            }
        )
        print(f"{name}: {nbytes / ms / 1e9:.2f} TB/s", flush=True)


# The 8B shape's linear layers in a decode step, whole (TP=1) and halved (TP=2): (name, N, K) of w [N, K].
GEMV_SHAPES = [
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
    ("lm_head", 128256, 4096),
    ("qkv tp2", 3072, 4096),
    ("o tp2", 4096, 2048),
    ("gate_up tp2", 14336, 4096),
    ("down tp2", 4096, 7168),
    ("lm_head tp2", 64128, 4096),
]
GEMV_CONFIGS = [
    (bn, bk, w) for bn in (4, 8, 16) for bk in (256, 512, 1024) for w in (4, 8) if bn * bk <= 8192
]


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Copies of a random weight [n, k], enough (400 MB, 2-16 of them) that a graph cycling through them finds none
    still in the L2."""
    copies = min(16, max(2, -(-400_000_000 // (n * k * 2))))
    return [torch.randn(n, k, device=DEV, dtype=DT) / k**0.5 for _ in range(copies)]


def gemv(copy_bw: float, quick: bool) -> None:
    """The Triton GEMV against torch's linear (cuBLAS) at 1, 2 and 4 rows: weight bytes over time in CUDA graphs,
    the graph cycling through enough copies of the weight that none is still in the L2 when read again."""
    for m in (1, 2, 4):
        for name, n, k in GEMV_SHAPES:
            nbytes = n * k * 2
            ws = weight_copies(n, k)
            x = torch.randn(m, k, device=DEV, dtype=DT)
            want = torch.nn.functional.linear(x.float(), ws[0].float())
            check(f"gemv {name} m={m} vs fp32", rel_err(tk.gemv(x, ws[0]), want), 1e-2)
            ms_torch = graph_ms([lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in ws])
            ms_ours = graph_ms([lambda w=w, x=x: tk.gemv(x, w) for w in ws])
            best = (ms_ours, None)
            sweep = {}
            for cfg in [] if quick or m > 1 else GEMV_CONFIGS:
                ms = graph_ms([lambda w=w, x=x, cfg=cfg: tk.gemv(x, w, None, cfg) for w in ws])
                sweep[repr(cfg)] = nbytes / ms / 1e9
                best = min(best, (ms, cfg), key=lambda t: t[0])
            row = {
                "name": name,
                "m": m,
                "n": n,
                "k": k,
                "bytes": nbytes,
                "ms_torch": ms_torch,
                "ms_ours": ms_ours,
                "ms_best": best[0],
                "best_cfg": repr(best[1]),
                "TBps_torch": nbytes / ms_torch / 1e9,
                "TBps_ours": nbytes / ms_ours / 1e9,
                "TBps_best": nbytes / best[0] / 1e9,
                "frac_copy_ours": nbytes / ms_ours / 1e-3 / copy_bw,
                "sweep_TBps": sweep,
            }
            RESULTS["gemv"].append(row)
            print(
                f"gemv {name} m={m}: torch {row['TBps_torch']:.2f} TB/s, ours {row['TBps_ours']:.2f}, best "
                f"{row['TBps_best']:.2f} ({row['best_cfg']})",
                flush=True,
            )
            del ws


MATMUL_ROWS = (8, 16, 32, 64, 96, 128, 160, 192, 224, 256)


def matmul(copy_bw: float) -> None:
    """A decode step's linear layers at the 8B shape (32 x qkv, o, gate_up, down, and the LM head) through torch's
    linear (cuBLAS), at the row counts of W1's decode steps, against each product's roofline: max(weight bytes at
    the copy bandwidth, FLOPs at the matmul rate). Timed in CUDA graphs over enough weight copies that none is
    still in the L2."""
    layers = [s for s in GEMV_SHAPES if "tp2" not in s[0]]
    weights = {name: weight_copies(n, k) for name, n, k in layers}
    # The same products with the weight stored [K, N] (x @ w), which takes other cuBLAS kernels.
    kn_ms = {name: {} for name, _, _ in layers}
    for m in MATMUL_ROWS:
        step_ms = roof_ms = bytes_ms = flops_ms = 0.0
        per_layer = {}
        for name, n, k in layers:
            x = torch.randn(m, k, device=DEV, dtype=DT)
            ms = graph_ms([lambda w=w, x=x: F.linear(x, w) for w in weights[name]])
            wts = [w.t().contiguous() for w in weights[name]]
            kn_ms[name][m] = graph_ms([lambda w=w, x=x: x @ w for w in wts])
            del wts
            t_bytes = n * k * 2 / copy_bw * 1e3  # ms
            t_flops = 2 * m * n * k / (MATMUL_TFLOPS * 1e9)
            roof = max(t_bytes, t_flops)
            times = 1 if name == "lm_head" else 32
            step_ms += times * ms
            roof_ms += times * roof
            bytes_ms += times * t_bytes
            flops_ms += times * t_flops
            per_layer[name] = {
                "ms": ms,
                "of_roofline": roof / ms,
                "ms_weight_kn": kn_ms[name][m],
                "of_roofline_weight_kn": roof / kn_ms[name][m],
            }
        row = {
            "m": m,
            "step_ms": step_ms,
            "roofline_ms": roof_ms,
            "bytes_ms": bytes_ms,
            "flops_ms": flops_ms,
            "of_roofline": roof_ms / step_ms,
            "layers": per_layer,
        }
        RESULTS["matmul"].append(row)
        print(
            f"matmul step m={m}: {step_ms:.2f} ms, roofline {roof_ms:.2f} ({100 * row['of_roofline']:.0f}%); "
            + ", ".join(
                f"{k} {100 * v['of_roofline']:.0f}% ([K, N]: {100 * v['of_roofline_weight_kn']:.0f}%)"
                for k, v in per_layer.items()
            ),
            flush=True,
        )
    del weights


def decode_layers(batch: int, layers: int, hq: int = 32, hkv: int = 8, d: int = 128) -> list[dict[str, Any]]:
    """`layers` distinct decode layers of `batch` sequences over W1-like contexts (uniform in [96, 1536], drawn
    from the batch size): each a paged cache, its tensors (`kv`, `bt`, `sl`, `qsl`), the new tokens' positions
    and slots, and the longest-first order the engine stages."""
    block_size = 16
    ctx = torch.randint(96, 1537, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    out = []
    for i in range(layers):
        _, kv, bt, sl, qsl = paged_batch([1] * batch, ctx, hq, hkv, d, block_size, seed=i)
        pos = (sl - 1).long()
        slots = bt.long().gather(1, (pos // block_size)[:, None])[:, 0] * block_size + pos % block_size
        order = torch.argsort(sl, descending=True, stable=True).to(torch.int32)
        out.append({"kv": kv, "bt": bt, "sl": sl, "qsl": qsl, "pos": pos, "slots": slots, "order": order})
    return out


RESIDUAL_ROWS = (8, 32, 96, 176, 256, 2048, 8192)


def residual(copy_bw: float) -> None:
    """The residual add of o_proj and down_proj two ways, at the 8B shape, in CUDA graphs over weight copies: the
    matmul, then the RMSNorm that adds the residual (reads two tensors, writes two: the engine's way), against the
    matmul accumulating into the residual stream (cuBLAS's beta = 1: `residual.addmm_(x, w.t())`), then a plain
    RMSNorm of it (reads one, writes one)."""
    h = 4096
    g = torch.randn(h, device=DEV, dtype=DT)
    for name, n, k in (("o", h, 4096), ("down", h, 14336)):
        ws = weight_copies(n, k)
        for m in RESIDUAL_ROWS:
            x = torch.randn(m, k, device=DEV, dtype=DT) / k**0.5
            res = torch.randn(m, h, device=DEV, dtype=DT)
            # Correctness of the accumulating form against fp32 (the residual stream itself changes each replay).
            want = res.float() + x.float() @ ws[0].float().t()
            got = res.clone().addmm_(x, ws[0].t())
            check(f"addmm residual {name} m={m} vs fp32", rel_err(got, want), 1e-2)

            def unfused(w: torch.Tensor, x: torch.Tensor = x, res: torch.Tensor = res) -> None:
                tk.rms_norm(F.linear(x, w), g, 1e-5, res)

            def fused(w: torch.Tensor, x: torch.Tensor = x, res: torch.Tensor = res) -> None:
                tk.rms_norm(res.addmm_(x, w.t()), g, 1e-5)

            ms_mm = graph_ms([lambda w=w, x=x: F.linear(x, w) for w in ws])
            ms_addmm = graph_ms([lambda w=w, x=x, res=res: res.addmm_(x, w.t()) for w in ws])
            ms_unfused = graph_ms([lambda w=w: unfused(w) for w in ws])
            ms_fused = graph_ms([lambda w=w: fused(w) for w in ws])
            row = {
                "layer": name,
                "m": m,
                "us_mm": 1e3 * ms_mm,
                "us_addmm": 1e3 * ms_addmm,
                "us_mm_then_norm_with_residual": 1e3 * ms_unfused,
                "us_addmm_then_norm": 1e3 * ms_fused,
            }
            RESULTS["residual"].append(row)
            print(
                f"residual {name} m={m}: mm {row['us_mm']:.1f} us, addmm {row['us_addmm']:.1f}; mm + norm(+res) "
                f"{row['us_mm_then_norm_with_residual']:.1f}, addmm + norm {row['us_addmm_then_norm']:.1f}",
                flush=True,
            )
        del ws


def overlap(copy_bw: float, layers: int = 6) -> None:
    """A decode layer's attention block at the 8B shape (qkv, rotary + KV write, attention, o) as the engine runs
    it, one kernel after the other, against the same work cut by KV-head groups, each group on a stream of its
    own: group g's qkv starts once group g-1's is done, so it runs beside g-1's attention (compute beside
    memory), and o_proj is summed over the groups' columns as their attention ends. No weight is read twice.
    W1-like contexts (uniform in [96, 1536]), `layers` distinct layers a graph so that nothing stays in the L2."""
    hq, hkv, d, hidden = 32, 8, 128, 4096
    scale = d**-0.5
    cos_sin = torch.randn(4096, d, device=DEV)
    # The groups' streams at the default priority, and at a higher one (so that a group's matmul is given SMs
    # before the rest of the previous group's attention programs).
    stream_sets = {
        "": [torch.cuda.Stream() for _ in range(4)],
        "_prio": [torch.cuda.Stream(priority=-1) for _ in range(4)],
    }
    for batch in (256, 192, 128, 64, 32):
        sets = decode_layers(batch, layers)
        ctx = (sets[0]["sl"] - 1).tolist()
        for s in sets:
            s["wqkv"] = torch.randn((hq + 2 * hkv) * d, hidden, device=DEV, dtype=DT) / hidden**0.5
            s["wo"] = torch.randn(hidden, hq * d, device=DEV, dtype=DT) / (hq * d) ** 0.5
        for s in sets:  # each group's rows of W_qkv (its q, k and v heads) and columns of W_o, contiguous
            w = s["wqkv"]
            for groups in (1, 2, 4):
                qs, ks = hq * d // groups, hkv * d // groups
                s[f"groups_{groups}"] = [
                    (
                        torch.cat(
                            (
                                w[g * qs : (g + 1) * qs],
                                w[hq * d + g * ks :][:ks],
                                w[(hq + hkv) * d + g * ks :][:ks],
                            )
                        ),
                        s["wo"][:, g * qs : (g + 1) * qs].contiguous(),
                    )
                    for g in range(groups)
                ]
        x = torch.randn(batch, hidden, device=DEV, dtype=DT)

        def block(
            s: dict[str, Any],
            groups: int,
            streams: list[torch.cuda.Stream],
            x: torch.Tensor = x,
            batch: int = batch,
        ) -> torch.Tensor:
            """The attention block over `groups` KV-head groups (1: the engine's sequence of kernels)."""
            gkv, gq = hkv // groups, hq // groups
            qs, ks = gq * d, gkv * d
            cur = torch.cuda.current_stream()
            done_qkv: list[torch.cuda.Event] = []
            done_attn: list[torch.cuda.Event] = []
            outs = []
            for g, (wg, _) in enumerate(s[f"groups_{groups}"]):
                st = cur if g == 0 else streams[g]
                if g:
                    st.wait_stream(cur)  # forks from the capturing stream (x is ready)
                    st.wait_event(done_qkv[-1])  # and starts its matmul once the last group's is done
                with torch.cuda.stream(st):
                    qkv = F.linear(x, wg)
                    done_qkv.append(torch.cuda.Event())
                    done_qkv[-1].record(st)
                    q, k, v = qkv.split([qs, ks, ks], dim=-1)
                    kvg = s["kv"][:, :, :, g * gkv : (g + 1) * gkv]
                    q = tk.rotary_write_kv(
                        s["pos"], q.view(batch, gq, d), k.view(batch, gkv, d), v.view(batch, gkv, d),
                        cos_sin, kvg, s["slots"],
                    )  # fmt: skip
                    a = tk.paged_attention(
                        q, kvg, s["bt"], s["sl"], s["qsl"], scale, max_query_len=1, max_seq_len=2048,
                        seq_order=s["order"],
                    )  # fmt: skip
                    done_attn.append(torch.cuda.Event())
                    done_attn[-1].record(st)
                    outs.append(a.view(batch, qs))
            o = None
            for g, (_, wo) in enumerate(s[f"groups_{groups}"]):
                cur.wait_event(done_attn[g])  # also joins group g's stream back into the capture
                o = F.linear(outs[g], wo) if o is None else o.addmm_(outs[g], wo.t())
            return o

        want = block(sets[0], 1, []).float()
        row: dict[str, Any] = {"batch": batch, "ctx_mean": sum(ctx) / batch}
        row["us_groups_1"] = 1e3 * graph_ms([lambda s=s: block(s, 1, []) for s in sets])
        for groups in (2, 4):
            for tag, streams in stream_sets.items():
                got = block(sets[0], groups, streams)
                check(f"attention block, {groups} groups{tag}, {batch} rows, vs 1", rel_err(got, want), 1e-2)
                row[f"us_groups_{groups}{tag}"] = 1e3 * graph_ms(
                    [lambda s=s, g=groups, st=streams: block(s, g, st) for s in sets]
                )
        RESULTS["overlap"].append(row)
        print(
            f"overlap {batch} x ~{row['ctx_mean']:.0f}: attention block a layer "
            + ", ".join(f"{k.removeprefix('us_')} {v:.1f} us" for k, v in row.items() if k.startswith("us_")),
            flush=True,
        )
        del sets
        torch.cuda.empty_cache()


def table() -> str:
    """The summary table, measured figures only."""
    lines = [
        f"device: {RESULTS['device']}; torch {torch.__version__}, triton {triton.__version__}",
        f"copy bandwidth (read+write): {RESULTS['copy']['TBps']:.2f} TB/s",
        f"checks: {sum(c['ok'] for c in RESULTS['checks'])}/{len(RESULTS['checks'])} ok "
        f"(worst rel err {max((c['rel_err'] for c in RESULTS['checks']), default=0.0):.1e})",
        "",
        "| decode 32/8/128 bf16 bs16 (graphs) | KV MB | ours us | ours TB/s | % copy | best cfg TB/s "
        "| ours eager us | SDPA us | SDPA TB/s | % copy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in RESULTS["decode"]:
        lines.append(
            f"| {r['batch']} x {r['ctx']} | {r['kv_bytes'] / 1e6:.0f} | {r['ms_default'] * 1e3:.1f} "
            f"| "
            f"{r['TBps_default']:.2f} | {100 * r['frac_copy_default']:.0f} | {r['TBps_best']:.2f} | "
            f"{r['ms_default_eager'] * 1e3:.1f} | "
            f"{min(r['ms_sdpa_rows'], r['ms_sdpa_gqa']) * 1e3:.1f} | {r['TBps_sdpa']:.2f} | "
            f"{100 * r['frac_copy_sdpa']:.0f} |"
        )
    if RESULTS["decode_ragged"]:
        lines += [
            "",
            "| decode, ragged contexts 96-1536 (graphs) | KV MB | auto splits | programs | TB/s by splits |",
            "|---|---|---|---|---|",
        ]
        for r in RESULTS["decode_ragged"]:
            for name in ("batch_order", "longest_first"):
                by = ", ".join(
                    f"{k.rsplit('_', 1)[1]}: {v:.2f}" for k, v in r.items() if k.startswith(f"TBps_{name}")
                )
                lines.append(
                    f"| {r['batch']} x ~{r['ctx_mean']:.0f} | {r['kv_bytes'] / 1e6:.0f} | {r['splits_auto']} "
                    f"| {name.replace('_', ' ')} | {by} |"
                )
    lines += [
        "",
        "| prefill bf16 causal | ours ms | ours TFLOP/s | best cfg TFLOP/s | SDPA ms "
        "| SDPA TFLOP/s | ours / SDPA |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in RESULTS["prefill"]:
        heads = "/".join(map(str, r["heads"]))
        lines.append(
            f"| {r['batch']} x {r['new']} new, {r['ctx']} cached, {heads} | "
            f"{r['ms_default']:.3f} | "
            f"{r['TFLOPs_default']:.0f} | {r['TFLOPs_best']:.0f} | "
            f"{min(r['ms_sdpa_gqa'], r['ms_sdpa_expanded']):.3f} | {r['TFLOPs_sdpa']:.0f} | "
            f"{100 * r['frac_sdpa_default']:.0f}% |"
        )
    lines += ["", "| kernel | MB moved | us | TB/s | % copy |", "|---|---|---|---|---|"]
    for r in RESULTS["small"]:
        lines.append(
            f"| {r['name']} | {r['bytes'] / 1e6:.0f} | {r['ms'] * 1e3:.1f} | {r['TBps']:.2f} | "
            f"{100 * r['frac_copy']:.0f} |"
        )
    if RESULTS["gemv"]:
        lines += [
            "",
            "| linear, w [N, K] bf16 (graphs) | rows | MB | torch us | torch TB/s | ours us | ours TB/s | % copy "
            "| best cfg TB/s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in RESULTS["gemv"]:
            lines.append(
                f"| {r['name']} {r['n']}x{r['k']} | {r['m']} | {r['bytes'] / 1e6:.0f} | {r['ms_torch'] * 1e3:.1f} | "
                f"{r['TBps_torch']:.2f} | {r['ms_ours'] * 1e3:.1f} | {r['TBps_ours']:.2f} | "
                f"{100 * r['frac_copy_ours']:.0f} | {r['TBps_best']:.2f} {r['best_cfg']} |"
            )
    if RESULTS["matmul"]:
        names = list(RESULTS["matmul"][0]["layers"])
        lines += [
            "",
            "| decode step's linears, 8B (torch, graphs) | ms | bytes-bound ms | FLOP-bound ms | of roofline | "
            + " | ".join(names)
            + " |",
            "|---|---|---|---|---|" + "---|" * len(names),
        ]
        for r in RESULTS["matmul"]:
            lines.append(
                f"| {r['m']} rows | {r['step_ms']:.2f} | {r['bytes_ms']:.2f} | {r['flops_ms']:.2f} | "
                f"{100 * r['of_roofline']:.0f}% | "
                + " | ".join(f"{100 * r['layers'][k]['of_roofline']:.0f}%" for k in names)
                + " |"
            )
    if "decode_host_us_per_call" in RESULTS:
        lines.append(
            f"\nhost time per decode attention call (64 seqs, eager): "
            f"{RESULTS['decode_host_us_per_call']:.1f} us"
        )
    return "\n".join(lines)


def main() -> None:
    """Run every section, then print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "benchmarks" / "out")))
    parser.add_argument("--quick", action="store_true", help="default configs only, no sweeps")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    args = parser.parse_args()
    torch.manual_seed(0)
    RESULTS["device"] = torch.cuda.get_device_name()
    run = set(args.sections)
    if "correctness" in run:
        correctness()
    copy_bw = copy_bandwidth()
    if "decode" in run:
        decode(copy_bw, args.quick)
    if "decode_ragged" in run:
        decode_ragged(copy_bw)
    if "prefill" in run:
        prefill(args.quick)
    if "mixed_attention" in run:
        mixed_attention(args.quick)
    if "small" in run:
        small(copy_bw)
    if "gemv" in run:
        gemv(copy_bw, args.quick)
    if "matmul" in run:
        matmul(copy_bw)
    if "residual" in run:
        residual(copy_bw)
    if "overlap" in run:
        overlap(copy_bw)
    text = table()
    RESULTS["table"] = text
    write_json(Path(args.out) / "kernels-h200.json", RESULTS)
    print("\n" + text)


if __name__ == "__main__":
    main()
