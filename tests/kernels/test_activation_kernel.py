"""SwiGLU kernel against `ref_silu_and_mul` in float64 (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from tinypaged import kernels as tk
from tinypaged import ops

# (rtol, atol) against the float64 definition: the kernel rounds once, at the store, so rtol is half an ulp
# of the output dtype plus fp32 slack; float16's atol covers products that land among its subnormals. For
# bfloat16 a whole ulp: the interpreter's fp32 -> bf16 cast truncates (the GPU's rounds to nearest even).
TOL = {
    torch.float32: (2e-6, 1e-12),
    torch.bfloat16: (2**-7 + 2e-6, 1e-12),
    torch.float16: (2**-11 + 2e-6, 2**-25),
}


def check(x: torch.Tensor, out: torch.Tensor) -> None:
    """out matches the definition computed in float64 from the same (rounded) x."""
    assert out.dtype == x.dtype and out.shape == (x.shape[0], x.shape[1] // 2)
    rtol, atol = TOL[x.dtype]
    torch.testing.assert_close(out.double(), ops.ref_silu_and_mul(x.double()), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (7, 1024 + 37), (0, 64)])
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """One row and several; an I below one tile, not a power of two, and past one tile (a masked tail)."""
    t, i = shape
    x = (3 * torch.randn(t, 2 * i, generator=torch.Generator().manual_seed(i))).to(dtype)
    check(x, tk.silu_and_mul(x))
    torch.testing.assert_close(ops.silu_and_mul(x), tk.silu_and_mul(x), rtol=0, atol=0)


def test_silu_and_mul_strided_rows_and_out() -> None:
    """Rows that are a slice of a wider tensor, written into a given (strided) output."""
    wide = torch.randn(7, 2 * 100 + 24, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x = wide[:, 8 : 8 + 2 * 100]
    assert not x.is_contiguous() and x.stride(1) == 1
    out_wide = torch.zeros(7, 128, dtype=torch.bfloat16)
    out = tk.silu_and_mul(x, out=out_wide[:, :100])
    assert out.data_ptr() == out_wide.data_ptr()
    check(x, out)
    assert (out_wide[:, 100:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 1024 + 37)])
def test_gelu_tanh_and_mul(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """Gemma's gate: gelu_tanh(gate) * up, as x * sigmoid(2u) in the kernel, against torch's tanh form."""
    t, i = shape
    x = (3 * torch.randn(t, 2 * i, generator=torch.Generator().manual_seed(i))).to(dtype)
    out = tk.silu_and_mul(x, gelu=True)
    rtol, atol = TOL[dtype]
    want = ops.ref_gelu_tanh_and_mul(x.double())
    torch.testing.assert_close(out.double(), want, rtol=rtol + 1e-6, atol=max(atol, 1e-6))
