"""RMSNorm kernel against `ref_rms_norm` (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from tinypaged import kernels as tk
from tinypaged import ops

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(7, 96), (2, 3, 64)])
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Plain, and fused with the residual add (a hidden size that is not a power of two too)."""
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=gen).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    out = tk.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, ops.ref_rms_norm(x, weight, 1e-5), atol=TOL[dtype], rtol=0)
    out, res = ops.rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_res = ops.ref_rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=TOL[dtype] * 4, rtol=TOL[dtype])
