"""RMSNorm with an optional fused residual add: one program per row, the whole row in registers.

The FP8 variant (`rms_norm_fp8`) quantizes the normalised row per token as it stores it (E4M3 and one float32
scale a row, kernels/fp8.py), for an FP8 layer that reads it: the row is first rounded to the activation dtype,
as the plain kernel stores it, so its values are exactly `fp8.quantize_per_token(rms_norm(...))`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import INTERPRET, dynamic_scale, quantize_e4m3
from .pdl import pdl_options, pdl_start


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    scale_ptr,
    eps,
    n_cols,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    FP8_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out = (x [+ residual]) * rsqrt(mean((x [+ residual])^2) + eps) * w, in fp32; also stores the sum. With
    FP8_OUT, out is that row (rounded to x's dtype) in E4M3 over its dynamic scale, stored at scale_ptr."""
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
    y = x * rstd * w
    if FP8_OUT:
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = dynamic_scale(tl.max(tl.abs(y), 0))
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * stride_o + cols, quantize_e4m3(y, scale, INTERPRET), mask=ok)
    else:
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _launch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, fp8: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(out `[R, C]`, the residual sum or None, the FP8 scales `[R, 1]` or None) of x's rows `[..., C]`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows, n_cols = x2.shape
    out = torch.empty(x2.shape, dtype=torch.float8_e4m3fn if fp8 else x.dtype, device=x.device)
    scale = torch.empty((n_rows, 1), dtype=torch.float32, device=x.device) if fp8 else None
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
            scale if scale is not None else x2,
            eps,
            n_cols,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            res_out.stride(0),
            HAS_RESIDUAL=residual is not None,
            FP8_OUT=fp8,
            BLOCK=block,
            INTERPRET=INTERPRET,
            num_warps=min(16, max(1, block // 256)),
            **pdl_options(x2),
        )
    return out, (res_out if residual is not None else None), scale


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim (semantics: `ops.ref_rms_norm`); with `residual` also returns the sum."""
    out, res_out, _ = _launch(x, weight, eps, residual, fp8=False)
    if res_out is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x `[T, C]` quantized per token: (E4M3 `[T, C]`, float32 scale `[T, 1]`, the residual sum `[T,
    C]` or None without `residual`); the quantized rows are exactly `fp8.quantize_per_token` of `rms_norm`'s."""
    assert x.dim() == 2
    q, res_out, scale = _launch(x, weight, eps, residual, fp8=True)
    assert scale is not None
    return q, scale, res_out
