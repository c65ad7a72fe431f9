"""RMSNorm with an optional fused residual add: one program per row, the whole row in registers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_options, pdl_start


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    eps,
    n_cols,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out = (x [+ residual]) * rsqrt(mean((x [+ residual])^2) + eps) * w, in fp32; also stores the sum."""
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        # The sum is rounded to the activation dtype before it is normalised, as the reference does.
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, s, mask=ok)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim (semantics: `ops.ref_rms_norm`); with `residual` also returns the sum."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows, n_cols = x2.shape
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, shape[-1])
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    else:
        r2 = res_out = x2
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        _rms_norm_kernel[(n_rows,)](
            x2,
            r2,
            weight,
            out,
            res_out,
            eps,
            n_cols,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            res_out.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
            **pdl_options(x2),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)
