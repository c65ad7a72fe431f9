"""The linear layers of a decode step of a few rows: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), in the model's
dtype (M <= 4).

At batch 1 a step's matmuls are matrix-vector products: they read every weight once and do two FLOPs a
weight, so their time is the weight bytes over the memory bandwidth. A program owns BLOCK_N output columns
(weight rows) and walks K in BLOCK_K steps, each thread keeping its own fp32 partial products (plain FMAs,
no cross-thread reduction inside the loop); the rows are summed once at the end. Wide tiles keep many loads in
flight per thread, the way a bandwidth-bound loop needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_options, pdl_start

MAX_ROWS = 4


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
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
    USE_PDL: tl.constexpr,
):
    """y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for the program's BLOCK_N columns n and every row m < M."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    pdl_start(USE_PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def default_config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [m, k] x [n, k]^T product. At one row, four weight rows of 1,024 a
    program (32 fp32 partials a thread): of the 24 tilings `benchmarks/kernel_speed.py` sweeps, the fastest on nine
    of the ten 8B layers (whole and halved) on an H200; QKV reads 6% faster at (8, 512, 4). Wider rows keep up
    to 64 partials a thread."""
    block_m = triton.next_power_of_2(m)
    block_k = min(triton.next_power_of_2(k), 1024 // block_m)
    return (4 if m == 1 else 8), block_k, 4


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: tuple[int, int, int]
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert bias is None or bias.shape == (n,)
    block_n, block_k, warps = config
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        **pdl_options(x),
    )
    return y


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """x `[M, K]` (M <= 4, rows contiguous) times weight `[N, K]` (rows contiguous), transposed, plus bias `[N]`:
    `[M, N]` in x's dtype, summed in fp32 (semantics: `torch.nn.functional.linear`). `config`: (BLOCK_N,
    BLOCK_K, num_warps), default `default_config`."""
    m, k = x.shape
    assert 1 <= m <= MAX_ROWS
    return _launch(x, weight, bias, config or default_config(m, weight.shape[0], k))
