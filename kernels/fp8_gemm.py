"""W8A8 FP8 matmul for small and middle batches: y[M, N] = (xq[M, K] * sx[M]) @ (wq[N, K] * sw[N])^T (+ bias).

Between the one-row GEMV and the row counts where cuBLASLt's FP8 matmul (`torch._scaled_mm`) runs at its full
rate, a decode step's matmuls are still bound by the weight bytes: at 64 rows cuBLASLt reads FP8 weights at
2.2-2.9 TB/s of the board's 4.3 (benchmarks/NOTES.md, "FP8 matmuls on this board"). Here a program owns a
BLOCK_M x BLOCK_N tile of the output and streams its BLOCK_N weight rows along K through the tensor cores
(E4M3 x E4M3 into float32, `tl.dot`), pipelined `num_stages` deep; the per-token and per-channel scales and the
bias are applied once, in the epilogue. Up to 32 token rows the tile is computed transposed, so that the FP8
tensor-core instruction takes the weight rows as its 64-row side (see `default_config`). No split-K: each
output element is summed by one program, in the same order at every batch size with the same tiling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_configs import num_sms
from .pdl import pdl_options, pdl_start


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_y,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of y: the FP8 products summed in float32 over K, then scaled per row and
    column (and the bias added). SWAP_AB: the tile computed transposed (row tiles under 64)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
    pdl_start(USE_PDL)
    # SWAP_AB: y^T = W x^T, the weight rows on the tensor cores' M side (64 and more, as sm_90's FP8 matmul
    # instruction needs), the few token rows on their N side.
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_rows + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if SWAP_AB:
        acc = tl.trans(acc)
    sx = tl.load(xs_ptr + rows, mask=row_ok, other=0.0)
    sw = tl.load(ws_ptr + cols, mask=col_ok, other=0.0)
    y = acc * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def default_config(m: int, n: int, k: int, sms: int = 132) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for an [m, k] x [n, k]^T product.

    sm_90's FP8 tensor-core instruction (wgmma) takes 64 rows and more on its M side; under that Triton falls
    back to fp16 MMAs, converting both operands (SASS: 96 E4M3 conversions an iteration at 16 x 32 x 256, none
    at 64 rows). So up to 32 rows the tile is computed transposed (`SWAP_AB`, chosen by a row tile under 64):
    the weight rows on the M side, 128 or 64 of them, the token rows (16 or 32) on the N side. From 33 rows the
    row tile is 64 and the column tile the widest of 128 and 64 that gives every multiprocessor a program, else
    32. The row counts where each tiling wins are the H200 sweep's to set (benchmarks/fp8_gemm_sweep.py)."""
    block_k = 128 if k >= 128 else max(32, triton.next_power_of_2(k))
    if m <= 32:
        block_m = max(16, triton.next_power_of_2(m))
        block_n = 128 if triton.cdiv(n, 128) >= sms else 64
        return block_m, block_n, block_k, 4, 4
    block_m = 64
    tiles_m = triton.cdiv(m, block_m)
    block_n = next((b for b in (128, 64) if triton.cdiv(n, b) * tiles_m >= sms), 32)
    return block_m, block_n, block_k, 4, 4


def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """E4M3 activations xq `[M, K]` with float32 scales `[M]` or `[M, 1]` (one a row) times E4M3 weights wq
    `[N, K]` with float32 scales `[N]` (one an output row), transposed, plus bias `[N]`: `[M, N]` in
    `out_dtype`, summed in float32 (semantics: `model.quant.fp8.ref_fp8_linear` on the dequantized values).
    Rows of xq and wq contiguous. `config`: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), default
    `default_config`."""
    m, k = xq.shape
    n = wq.shape[0]
    assert wq.shape[1] == k and xq.stride(1) == 1 and wq.stride(1) == 1
    assert x_scale.numel() == m and w_scale.numel() == n and (bias is None or bias.shape == (n,))
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    if config is None:
        config = default_config(m, n, k, num_sms(xq.device) if xq.is_cuda else 132)
    block_m, block_n, block_k, warps, stages = config
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _fp8_gemm_kernel[grid](
        xq,
        x_scale,
        wq,
        w_scale,
        bias if bias is not None else w_scale,
        y,
        m,
        n,
        k,
        xq.stride(0),
        wq.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SWAP_AB=block_m < 64,
        num_warps=warps,
        num_stages=stages,
        **pdl_options(xq),
    )
    return y
