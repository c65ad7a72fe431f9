"""W8A8 FP8 matmul for small and middle batches: y[M, N] = (xq[M, K] * sx[M]) @ (wq[N, K] * sw[N])^T (+ bias).

Between the one-row GEMV and the row counts where cuBLASLt's FP8 matmul (`torch._scaled_mm`) runs at its full
rate, a decode step's matmuls are still bound by the weight bytes: at 64 rows cuBLASLt reads FP8 weights at
2.2-2.9 TB/s of the board's 4.3 (benchmarks/NOTES.md, "FP8 matmuls on this board"). Here a program owns a
BLOCK_M x BLOCK_N tile of the output and streams its BLOCK_N weight rows along K through the tensor cores
(E4M3 x E4M3 into float32, `tl.dot`), pipelined `num_stages` deep; the per-token and per-channel scales and the
bias are applied once, in the epilogue. Up to 32 token rows the tile is computed transposed, so that the FP8
tensor-core instruction takes the weight rows as its 64-row side (see `default_config`).

The same kernel, unscaled (`SCALED` off), multiplies bf16 or fp16 operands at a few rows (`skinny_matmul`): a
verification step's 5-16 rows, small decode batches. cuBLAS reads the weights at 16 rows as fast as at 1, but
its kernels launch without programmatic dependent launch, and several split K with a second reduce launch.

Split-K, deterministic. A layer of 4,096 weight rows makes only 64 tiles of 64 rows: too few programs to keep
132 multiprocessors reading. So such a layer's K is cut into pieces of `k_split` columns, one program a tile
and piece. Each writes its float32 partial sums to a workspace and counts itself in on the tile's counter; the
last to arrive adds the partials up in piece order (never in arrival order), applies the scales and stores the
tile, and sets the counter back to zero for the next launch. Up to 32 rows `k_split` depends on the layer's shape
only (`split_k`), so a row's sums are taken in the same order at every row count from 1 to 32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_configs import num_sms
from .pdl import pdl_options, pdl_start

MAX_TILES = 4096  # tile counters a device holds for split launches (a split layer has a few hundred tiles)
_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    K_SPLIT,
    stride_x,
    stride_w,
    stride_y,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    SPLIT: tl.constexpr,
    SCALED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of y: the FP8 products summed in float32 over K (SPLIT: over piece
    program_id(2) of K_SPLIT columns, the pieces then added by the tile's last program), scaled per row and
    column (SCALED; else bf16 or fp16 products, unscaled), the bias added. SWAP_AB: the tile computed
    transposed (row tiles under 64)."""
    # Row tiles fastest: the programs that read the same weight rows run side by side (the weight from the L2).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
    k_lo = 0
    k_hi = K
    if SPLIT:
        k_lo = tl.program_id(2) * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
    pdl_start(USE_PDL)
    # SWAP_AB: y^T = W x^T, the weight rows on the tensor cores' M side (64 and more, as sm_90's FP8 matmul
    # instruction needs), the few token rows on their N side.
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k0 + ks) < k_hi
        x = tl.load(x_rows + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if SWAP_AB:
        acc = tl.trans(acc)
    if SPLIT:
        part = part_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tile = pid_n * tl.num_programs(0) + pid_m
        last, acc = split_sum(acc, part, row_ok[:, None] & col_ok[None, :], M * N, count_ptr + tile)
        if last:
            _epilogue(
                acc, rows, cols, row_ok, col_ok, xs_ptr, ws_ptr, b_ptr, y_ptr, stride_y, HAS_BIAS, SCALED
            )
    else:
        _epilogue(acc, rows, cols, row_ok, col_ok, xs_ptr, ws_ptr, b_ptr, y_ptr, stride_y, HAS_BIAS, SCALED)


@triton.jit
def split_sum(acc, part, ok, piece_stride, counter):
    """One piece of a split-K tile (the grid's third axis): its float32 partial `acc` stored at `part` (this
    piece's at `part + piece * piece_stride`), the program counted in on the tile's `counter`; the last to arrive
    gets (True, the sum of every piece in piece order: deterministic) and sets the counter back to zero for the
    next launch, the others (False, zeros)."""
    pieces = tl.num_programs(2)
    tl.store(part + tl.program_id(2) * piece_stride, acc, mask=ok)
    # Every thread's partial stored before one thread counts the program in (the counter's release publishes
    # them); the last program's acquire makes every piece visible to it.
    tl.debug_barrier()
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == pieces - 1
    total = tl.zeros(acc.shape, dtype=tl.float32)
    if last:
        for p in range(0, pieces):
            total += tl.load(part + p * piece_stride, mask=ok, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    return last, total


@triton.jit
def _epilogue(
    acc,
    rows,
    cols,
    row_ok,
    col_ok,
    xs_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    stride_y,
    HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr,
):
    """A tile's float32 sums scaled per row and column (SCALED), plus the bias, stored in y's dtype."""
    y = acc
    if SCALED:
        sx = tl.load(xs_ptr + rows, mask=row_ok, other=0.0)
        sw = tl.load(ws_ptr + cols, mask=col_ok, other=0.0)
        y = acc * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def split_k(n: int, k: int, sms: int = 132, block_k: int = 128, programs_per_sm: int = 2) -> int:
    """The K columns of one split piece for an [*, k] x [n, k]^T product (0: no split), from the layer's shape:
    pieces enough that its 64-row tiles make about `programs_per_sm` programs a multiprocessor, each piece at
    least four K tiles long."""
    tiles = triton.cdiv(n, 64)
    iters = triton.cdiv(k, block_k)
    pieces = max(1, min(iters // 4, round(programs_per_sm * sms / tiles)))
    if pieces == 1:
        return 0
    return triton.cdiv(iters, pieces) * block_k


def default_config(m: int, n: int, k: int, sms: int = 132) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, k_split) for an [m, k] x [n, k]^T product, from the
    H200 sweep of the 8B layers at 1-256 rows (benchmarks/fp8_gemm_sweep.py, NOTES.md).

    sm_90's FP8 tensor-core instruction (wgmma) takes 64 rows and more on its M side; under that Triton falls
    back to fp16 MMAs, converting both operands. So up to 32 rows the tile is computed transposed (`SWAP_AB`,
    chosen by a row tile under 64): 64 weight rows on the M side, the 16 or 32 token rows on the N side, K split
    as `split_k` says for the layer's shape, so that every step of 1-32 rows sums a row in the same order.
    From 33 rows the tiles are 64 and from 65 rows 128 token rows (eight warps) by 64 weight rows (128 where the
    layer is wide), split only where the layer's tiles leave most multiprocessors idle. Five pipeline stages,
    three on the wide layers (gate_up: many programs a multiprocessor already).

    Up to 32 rows a layer that is not wide steps through K 256 columns at a time and is split for about one
    program a multiprocessor (run 98's sweep at 1 and 16 rows: QKV whole 8.3 against 12.4 us, O in two pieces
    6.9-7.2 against 7.5-8.0, down in two 17.1-18.2 against 17.6-18.7): a 128-column step moved too few bytes
    for the latency of each. The wide layers keep 128 columns and no split (gate_up 30.5 against 34.9)."""
    block_k = 128 if k >= 128 else max(32, triton.next_power_of_2(k))
    wide = triton.cdiv(n, 64) >= 2 * sms
    stages = 3 if wide else 5
    if m <= 32:
        if not wide and k >= 256:
            return (
                max(16, triton.next_power_of_2(m)),
                64,
                256,
                4,
                5,
                split_k(n, k, sms, 256, programs_per_sm=1),
            )
        return max(16, triton.next_power_of_2(m)), 64, block_k, 4, stages, split_k(n, k, sms, block_k)
    k_split = split_k(n, k, sms, block_k, programs_per_sm=1)
    if m <= 64:
        return 64, 64, block_k, 4, stages, k_split
    return 128, 128 if wide else 64, block_k, 8, stages, k_split


def skinny_config(m: int, n: int, k: int, sms: int = 132) -> tuple[int, int, int, int, int, int]:
    """`default_config`'s counterpart for bf16 or fp16 operands at up to 32 rows, from the H200 sweep of the 8B
    layers (benchmarks/skinny_matmul.py, run 94): the tile transposed, 64 weight rows by the rows rounded up to
    16; K split for about one program a multiprocessor, not two (a K step of bf16 reads twice an FP8 step's
    bytes): QKV whole, O and down_proj in two pieces; five pipeline stages, four on the wide layers."""
    block_k = 128 if k >= 128 else max(32, triton.next_power_of_2(k))
    stages = 4 if triton.cdiv(n, 64) >= 2 * sms else 5
    k_split = split_k(n, k, sms, block_k, programs_per_sm=1)
    return max(16, triton.next_power_of_2(m)), 64, block_k, 4, stages, k_split


def tile_counters(device: torch.device) -> torch.Tensor:
    """The device's split-launch tile counters: zero between launches (each tile's last program resets its own)."""
    if device not in _counters:
        _counters[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _counters[device]


def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: tuple[int, int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """E4M3 activations xq `[M, K]` with float32 scales `[M]` or `[M, 1]` (one a row) times E4M3 weights wq
    `[N, K]` with float32 scales `[N]` (one an output row), transposed, plus bias `[N]`: `[M, N]` in
    `out_dtype`, summed in float32 (semantics: `model.quant.fp8.ref_fp8_linear` on the dequantized values).
    Rows of xq and wq contiguous. `config`: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, k_split),
    default `default_config`; k_split a multiple of BLOCK_K, 0 for no split."""
    assert x_scale.numel() == xq.shape[0] and w_scale.numel() == wq.shape[0]
    return _launch(xq, wq, bias, out_dtype, config, (x_scale, w_scale))


def skinny_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """`x @ weight^T + bias` for bf16 or fp16 x `[M, K]` and weight `[N, K]` (rows contiguous), summed in float32
    and stored in x's dtype: the FP8 matmul's kernel unscaled, for a few rows (`ops.linear` sends it 2-16).
    Up to 16 rows a row's sums are taken in the same order at every row count (the tile and the split depend on
    the layer's shape only), so a row alone and within a batch get the same bits. `config` as `fp8_gemm`'s,
    default `skinny_config` up to 32 rows."""
    assert x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
    m, k = x.shape
    if config is None and m <= 32:
        config = skinny_config(m, weight.shape[0], k, num_sms(x.device) if x.is_cuda else 132)
    return _launch(x, weight, bias, x.dtype, config, None)


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: tuple[int, int, int, int, int, int] | None,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """The kernel over x `[M, K]` and w `[N, K]`, with per-row and per-column `scales` or none."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1
    assert bias is None or bias.shape == (n,)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return y
    if config is None:
        config = default_config(m, n, k, num_sms(x.device) if x.is_cuda else 132)
    block_m, block_n, block_k, warps, stages, k_split = config
    assert k_split % block_k == 0
    pieces = triton.cdiv(k, k_split) if k_split else 1
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), pieces)
    if pieces > 1:
        assert grid[0] * grid[1] <= MAX_TILES and pieces * m * n < 2**31
        part, counters = (
            torch.empty((pieces, m, n), dtype=torch.float32, device=x.device),
            tile_counters(x.device),
        )
    else:
        part = counters = y
    x_scale, w_scale = scales if scales is not None else (y, y)
    _fp8_gemm_kernel[grid](
        x,
        x_scale,
        w,
        w_scale,
        bias if bias is not None else y,
        y,
        part,
        counters,
        m,
        n,
        k,
        k_split,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SWAP_AB=block_m < 64,
        SPLIT=pieces > 1,
        SCALED=scales is not None,
        num_warps=warps,
        num_stages=stages,
        **pdl_options(x),
    )
    return y
