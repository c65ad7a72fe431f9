"""Paged attention for ragged batches: one Triton kernel, launched in decode mode and/or prefill mode.

Each program owns one KV head and a tile of BLOCK_M rows; a row is (query token, query head) with the G query
heads that share the KV head packed side by side (GQA packing), so each KV tile is read once for all of them.
- Decode mode (sequences with one new token, or up to `short_query_len`: a speculative verification's k + 1):
  program = (KV head, sequence x split), its rows the sequence's new tokens x the G query heads; the sequence's
  KV tiles are divided evenly among the splits, which write fp32 partials that `_reduce_kernel` combines
  (flash decoding). With a `seq_order` (the sequences longest first), the programs take the sequences in
  that order: the GPU starts programs in grid order, so on ragged contexts the long ones no longer run alone
  at the end of the launch (longest-processing-time-first scheduling).
- Prefill mode (the other sequences): program = (query block, KV head); a query block
  holds BLOCK_M // G consecutive new tokens of one sequence, found by binary search over `query_start_loc`,
  so that the grid is sized from tensor shapes alone (no host sync).
Both launches cover the first min(sequences, tokens) sequences only (in row order, and in decode order): one
with new tokens never follows one without (a mixed-step graph's padding rows, 256 for a 16-token graph, come
last), so the rest have nothing to attend for.
Keys are read through the block table one token row at a time; tiles wholly below the causal diagonal run
without masks, the rest (diagonal, end of sequence) with them. With a sliding window (WINDOWED), a program
starts at the tile of its first row's first visible key and masks the tiles its rows' windows begin in; keys
below that first visible key are not read at all, so their blocks may have been freed and their block-table
entries reused or left stale. Softmax is online, in fp32, in base 2.
An FP8 cache's tiles are converted to the query's dtype as they are loaded (exact: E4M3 values are fp16 and bf16
values; bf16 queries are made fp16 first, E4M3's one-instruction conversion on sm_90); its scales cost nothing per
key: k_scale is in the softmax scale, v_scale multiplies a program's output once.

One job, past 450 lines: one kernel and its launcher. Decode and prefill share the tile loop, the GQA packing
and the online softmax, and split-KV's reduce reads the partials that layout writes; split apart, each mode
would repeat that code (the tile configs live in attention_configs.py already).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import attention_fp8
from .attention_configs import AttnConfig, choose_num_splits, decode_program, default_configs, launch_options
from .pdl import pdl_options, pdl_start

_LOG2E = 1.4426950408889634
# A finite "minus infinity" for the running max: a row or split that sees no key keeps l = 0 without NaNs.
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _find_seq(query_start_loc, target, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence whose first query block, `query_start_loc[i] // BLOCK_Q + i`, is <= target."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if first <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tiles(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    k_ptr,
    v_ptr,
    bt_row,
    kv_head_off,
    seq_len,
    tile_lo,
    tile_hi,
    gap_at,
    gap,
    stride_kb,
    stride_kt,
    qk_scale,
    window,
    min_key,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) with KV tiles [tile_lo, tile_hi) of one sequence/KV head, those
    from `gap_at` on shifted up by `gap` (MASKED only: the tiles at a window's edge, then those at the diagonal,
    in one loop); where MASKED, keys at or past seq_len, after a row's position or (WINDOWED) `window` or more
    before it, and below `min_key` (not read) are masked."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for i in range(tile_lo, tile_hi):
        if MASKED:
            tile = tl.where(i >= gap_at, i + gap, i)
        else:
            tile = i
        k_pos = tile * BLOCK_N + offs_n
        if MASKED:
            kv_ok = k_pos < seq_len
            if WINDOWED:
                kv_ok = kv_ok & (k_pos >= min_key)
            block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        else:
            block = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
        row_off = block * stride_kb + (k_pos % BLOCK_SIZE).to(tl.int64) * stride_kt + kv_head_off
        kv_off = row_off[:, None] + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptr + kv_off, mask=kv_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + kv_off)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * qk_scale
        if MASKED:
            visible = k_pos[None, :] <= q_pos[:, None]
            if WINDOWED:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptr + kv_off, mask=kv_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptr + kv_off)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def _paged_attn_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    seq_order_ptr,
    qk_scale,
    v_scale,
    window,
    num_seqs,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_bt,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr,
    SHORT_Q: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    ORDERED: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Attention of one tile of packed (query token, query head) rows over one sequence's paged K/V (an FP8
    cache's: `qk_scale` holds its k_scale, and the output is multiplied by `v_scale`), each row within its
    `window` where WINDOWED."""
    pdl_start(USE_PDL)
    # The KV head varies fastest across programs, so that the programs reading the same blocks (which hold
    # every KV head of their tokens) run side by side.
    kv_head = tl.program_id(0)
    k_ptr = kv_ptr
    v_ptr = kv_ptr + stride_kv
    split = 0
    if DECODE:
        seq, split = decode_program(seq_order_ptr, num_splits, SPLIT_KV, ORDERED)
        q_block = 0
    else:
        # Reversed so that the last (longest, under the causal mask) query blocks start first.
        target = tl.num_programs(1) - 1 - tl.program_id(1)
        seq = _find_seq(query_start_loc_ptr, target, num_seqs, BLOCK_Q)
        q_block = target - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if DECODE:
        if (q_len == 0) | (q_len > BLOCK_Q):  # no new token, or a prefill the other launch runs
            return
    else:
        if q_block * BLOCK_Q >= q_len:
            return
        if q_len <= SHORT_Q:  # left to the decode launch of the same batch
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = offs_m // G
    head = kv_head * G + offs_m % G
    q_idx = q_block * BLOCK_Q + tok
    row_ok = (tok < BLOCK_Q) & (q_idx < q_len)
    q_pos = ctx_len + q_idx
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if KV_FP8 and q.dtype == tl.bfloat16:
        # The dots run in fp16: E4M3 converts to fp16 in one instruction for two values, to bf16 only through
        # fp16 (one more a value); fp16 also holds q and p more finely than bf16 (sums stay fp32).
        q = q.to(tl.float16)

    # Keys [0, first_pos] are visible to every row; the last row of the block sees keys [0, end).
    first_pos = ctx_len + q_block * BLOCK_Q
    end = tl.minimum(first_pos + BLOCK_Q, seq_len)
    n_tiles = tl.cdiv(end, BLOCK_N)
    n_full = tl.minimum((first_pos + 1) // BLOCK_N, n_tiles)
    # Windowed: keys from min_key on are visible to some row, those from full_key on to every row (up to
    # first_pos); tiles [first, n_win) are masked at the window's edge, [n_win, n_full) run without masks.
    min_key = 0
    first = 0
    n_win = 0
    if WINDOWED:
        min_key = tl.maximum(first_pos - window + 1, 0)
        first = min_key // BLOCK_N
        n_win = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(end - window, 0), BLOCK_N), first), n_full)
    if SPLIT_KV:
        per_split = tl.cdiv(n_tiles - first, num_splits)
        lo = tl.minimum(first + split * per_split, n_tiles)
        hi = tl.minimum(lo + per_split, n_tiles)
    else:
        lo = first
        hi = n_tiles
    # The masked tiles of [lo, hi): [lo, win_end) at the window's edge, then [win_end + gap, hi) at the diagonal.
    win_end = tl.minimum(tl.maximum(n_win, lo), hi)
    gap = tl.minimum(tl.maximum(n_full, lo), hi) - win_end

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_kh
    acc, l_i, m_i = _attend_tiles(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        k_ptr,
        v_ptr,
        bt_row,
        kv_head_off,
        seq_len,
        tl.maximum(lo, n_win),
        tl.minimum(hi, n_full),
        0,
        0,
        stride_kb,
        stride_kt,
        qk_scale,
        window,
        min_key,
        BLOCK_SIZE,
        BLOCK_N,
        HEAD_DIM,
        False,
        WINDOWED,
        DOT_PREC,
    )
    acc, l_i, m_i = _attend_tiles(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        k_ptr,
        v_ptr,
        bt_row,
        kv_head_off,
        seq_len,
        lo,
        hi - gap,
        win_end,
        gap,
        stride_kb,
        stride_kt,
        qk_scale,
        window,
        min_key,
        BLOCK_SIZE,
        BLOCK_N,
        HEAD_DIM,
        True,
        WINDOWED,
        DOT_PREC,
    )
    if KV_FP8:
        acc = acc * v_scale  # sum_j p_j (v_j * v_scale), once per row instead of once per key

    if SPLIT_KV:
        # Partials [num_splits, num_seqs, BLOCK_Q, Hq, D] (unnormalised) and [2, num_splits, num_seqs, BLOCK_Q,
        # Hq] (m, l): a row per new token of a decode-mode sequence (BLOCK_Q of them at most).
        hq = tl.num_programs(0) * G
        part_row = ((split * num_seqs + seq) * BLOCK_Q + tok).to(tl.int64) * hq + head
        tl.store(part_o_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        ml_stride = num_splits * num_seqs * BLOCK_Q * hq
        tl.store(part_ml_ptr + part_row, m_i, mask=row_ok)
        tl.store(part_ml_ptr + ml_stride + part_row, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def _reduce_kernel(
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
    query_start_loc_ptr,
    seq_order_ptr,
    num_seqs,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ORDERED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Combine the split-KV partials of one (decode-mode sequence, query head, new token) into its output row;
    the sequence is the decode launch's of the same rank."""
    pdl_start(USE_PDL)
    if ORDERED:
        seq = tl.load(seq_order_ptr + tl.program_id(0))
    else:
        seq = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if (q_len > BLOCK_Q) | (tok >= q_len):  # a prefill the other launch wrote, or no such token
        return
    hq = tl.num_programs(1)
    offs_s = tl.arange(0, SPLITS_POW2)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    part_row = ((offs_s * num_seqs + seq) * BLOCK_Q + tok).to(tl.int64) * hq + head
    m = tl.load(part_ml_ptr + part_row, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + num_splits * num_seqs * BLOCK_Q * hq + part_row, mask=s_ok, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    acc = tl.load(part_o_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    # A row that saw no key (a padding row: length 0) is zeros, as without splits, not 0 / 0.
    denom = tl.sum(l_s * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    o_ptrs = out_ptr + (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    seq_order: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    configs: tuple[AttnConfig, AttnConfig] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    short_query_len: int = 1,
) -> torch.Tensor:
    """Causal attention of a ragged batch over its paged KV cache (semantics: `ops.ref_paged_attention`), each
    token within its last `window` positions where given.

    `max_query_len` (longest new-token run in the batch) and `max_seq_len` (an upper bound of `seq_lens`) are
    hints that keep the launch free of host syncs; without them `max_query_len` is 1 when T == B and is read
    from `query_start_loc` otherwise, and `max_seq_len` is bounded by the block table's width.
    `num_kv_splits` forces the decode split count (1 = no split-KV). `seq_order` `[B]` int32, a permutation of the
    sequences (longest first), is the order the decode programs take them in; it changes the speed, not the
    result. In row order and in that order, no sequence with new tokens may follow one without: with fewer
    tokens than sequences, the launches cover the first T only. `out` is an optional `[T, Hq, D]`
    output. `k_scale` and `v_scale` are an FP8 cache's scales (plain arguments of the launch: a CUDA graph keeps
    the values it was captured with, fixed once the model is loaded).
    `short_query_len`: sequences with up to this many new tokens (a speculative verification's k + 1) go to the
    decode launch, whose programs split the context (flash decoding), instead of the prefill launch, where one
    program a KV head walks the whole context; 1 (the default): single new tokens only.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, kv_dim = kv_layer.shape
    num_seqs = seq_lens.shape[0]
    g = num_heads // num_kv_heads
    assert num_heads == g * num_kv_heads and kv_dim == head_dim, "bad head counts or head dims"
    assert head_dim == triton.next_power_of_2(head_dim) and head_dim >= 16, "head_dim must be a power of 2"
    assert kv_layer.stride(-1) == 1 and q.stride(-1) == 1 and block_tables.stride(-1) == 1
    if max_query_len is None:  # T == B: every sequence has its one new token (a scheduled one has >= 1)
        max_query_len = 1 if num_tokens == num_seqs else int(query_start_loc.diff().max())
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    decode_cfg, prefill_cfg = configs or default_configs(q, g)
    kv_fp8 = kv_layer.dtype == torch.float8_e4m3fn
    common = dict(
        qk_scale=scale * _LOG2E * (float(k_scale) if kv_fp8 else 1.0),
        v_scale=float(v_scale),
        window=window or 0,
        num_seqs=num_seqs,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_kv=kv_layer.stride(0),
        stride_kb=kv_layer.stride(1),
        stride_kt=kv_layer.stride(2),
        stride_kh=kv_layer.stride(3),
        stride_bt=block_tables.stride(0),
        G=g,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8,
        WINDOWED=window is not None,
        **pdl_options(q),
    )
    tensors = (block_tables, seq_lens, query_start_loc)
    assert seq_order is None or seq_order.shape == (num_seqs,)

    short = max(1, short_query_len)
    # A mixed-step graph keeps every sequence row (max_num_seqs), most of them empty and after the rest (in row
    # and in decode order): only the first min(sequences, tokens) can have new tokens, and both launches cover
    # those alone (a verification at batch 1 in a 16-token graph: 16, not 256; the prefill launch's empty
    # programs each ran a binary search over every row: 19 us a layer in run 84).
    ranks = min(num_seqs, num_tokens)
    if max_query_len > short:
        cfg = prefill_cfg
        block_q = cfg.block_m // g
        grid = (num_kv_heads, triton.cdiv(num_tokens, block_q) + ranks, 1)
        _paged_attn_kernel[grid](
            q,
            kv_layer,
            out,
            out,
            out,
            *tensors,
            seq_lens,
            **(common | {"num_seqs": ranks}),
            BLOCK_M=cfg.block_m,
            BLOCK_Q=block_q,
            BLOCK_N=cfg.block_n,
            num_splits=1,
            DECODE=False,
            SHORT_Q=short,
            SPLIT_KV=False,
            ORDERED=False,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **launch_options(q, cfg),
        )
        if num_tokens >= num_seqs * max_query_len:  # every sequence has max_query_len (> short) new tokens
            return out

    cfg = decode_cfg
    # The most new tokens of a sequence the decode launch takes: `short` whenever a step may hold more than one
    # (one variant a model, compiled by the mixed-step graphs' capture, not by each eager step's longest run).
    block_q = short if max_query_len > 1 else 1
    if block_q > 1:
        # a row per (new token, query head): a taller tile, without the one-token tile's register cap
        rows = max(cfg.block_m, triton.next_power_of_2(block_q * g))
        cfg = AttnConfig(rows, cfg.block_n, cfg.num_warps, cfg.num_stages)
    longest = max_seq_len if window is None else min(max_seq_len, window + cfg.block_n)
    # With short queries (a verification's k + 1 tokens) the split count is chosen for a sequence every k + 1
    # tokens (a 16-token graph: 4), so that a verification's context splits.
    live = num_seqs if block_q == 1 else min(num_seqs, triton.cdiv(num_tokens, block_q))
    # Single new tokens over an FP8 cache go to the Gluon kernel (kernels/attention_fp8.py) from 32 sequences (8
    # KV heads) up, with its own split choice for its one-warp programs.
    gluon = attention_fp8.usable(q, kv_layer, window, block_q, live)
    if gluon:
        splits = num_kv_splits or attention_fp8.splits(live, num_kv_heads, longest, q)
    else:
        splits = num_kv_splits or choose_num_splits(q, live, num_kv_heads, longest, cfg.block_n)
    if splits > 1:
        part_o = torch.empty(
            (splits, num_seqs, block_q, num_heads, head_dim), dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty((2, splits, num_seqs, block_q, num_heads), dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out
    assert ranks * splits < 2**16, "too many decode programs for the grid's second axis"
    if gluon:
        attention_fp8.fp8_decode(
            q, kv_layer, out, block_tables, seq_lens, query_start_loc, seq_order, common["qk_scale"],
            common["v_scale"], ranks, splits, part_o, part_ml,
        )  # fmt: skip
    else:
        _paged_attn_kernel[(num_kv_heads, ranks * splits, 1)](
            q,
            kv_layer,
            out,
            part_o,
            part_ml,
            *tensors,
            seq_lens if seq_order is None else seq_order,
            **common,
            BLOCK_M=cfg.block_m,
            BLOCK_Q=block_q,
            BLOCK_N=cfg.block_n,
            num_splits=splits,
            DECODE=True,
            SHORT_Q=block_q,
            SPLIT_KV=splits > 1,
            ORDERED=seq_order is not None,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **launch_options(q, cfg),
        )
    if splits > 1:
        _reduce_kernel[(ranks, num_heads, block_q)](
            out,
            part_o,
            part_ml,
            query_start_loc,
            seq_lens if seq_order is None else seq_order,
            num_seqs,
            splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            SPLITS_POW2=triton.next_power_of_2(splits),
            BLOCK_Q=block_q,
            ORDERED=seq_order is not None,
            num_warps=4,
            **pdl_options(q),
        )
    return out
