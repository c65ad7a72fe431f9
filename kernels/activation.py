"""SwiGLU (and Gemma's GELU-tanh gated variant) of a fused gate/up projection: one program per (token row, tile
of output columns). The SwiGLU's FP8 variant, quantized per token for an FP8 down projection, is in
kernels/fp8.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_options, pdl_start


@triton.jit
def swiglu(x_row, n_cols, cols, ok):
    """silu(gate) * up over columns `cols` of one row of x (gate then up), in fp32."""
    gate = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_row + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    # One rounding, at the store (the torch reference rounds silu(gate) to x's dtype before the multiply).
    return gate * tl.sigmoid(gate) * up


@triton.jit
def geglu_tanh(x_row, n_cols, cols, ok):
    """gelu_tanh(gate) * up over columns `cols` of one row of x (gate then up), in fp32: 0.5 g (1 + tanh(u))
    is g * sigmoid(2 u), with u = sqrt(2 / pi) (g + 0.044715 g^3)."""
    gate = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_row + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    return gate * tl.sigmoid(2.0 * u) * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    n_cols,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    GELU: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[t, c] = act(x[t, c]) * x[t, I + c] over one tile of columns c of row t, in fp32 (act: silu, or
    gelu_tanh where GELU)."""
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    if GELU:
        out = geglu_tanh(x_ptr + row * stride_x, n_cols, cols, ok)
    else:
        out = swiglu(x_ptr + row * stride_x, n_cols, cols, ok)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
    """silu(gate) * up of x `[T, 2 * I]` (gate then up) into `out` `[T, I]` (semantics: `ops.ref_silu_and_mul`);
    with `gelu`, gelu_tanh(gate) * up (`ops.ref_gelu_tanh_and_mul`).

    Rows of x may have any stride (a slice of a wider tensor) as long as each row is contiguous.
    """
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1
    n_rows, n_cols = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    assert out.shape == (n_rows, n_cols) and out.stride(1) == 1
    if n_rows:
        # Column tiles keep the registers per program fixed, from I = 64 up to 14336 (Llama-3.1-8B).
        block = min(1024, triton.next_power_of_2(n_cols))
        _silu_and_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](
            x,
            out,
            n_cols,
            x.stride(0),
            out.stride(0),
            BLOCK=block,
            GELU=gelu,
            num_warps=4,
            **pdl_options(x),
        )
    return out
