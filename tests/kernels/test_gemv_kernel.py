"""The decode-step GEMV against torch's linear in float64 (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from tinypaged import kernels as tk
from tinypaged import ops

# The kernel sums in fp32 and rounds once, at the store: against the float64 product of the same (rounded)
# inputs, an fp32 sum's error over K terms plus half an ulp of the output dtype (a whole one for bfloat16: the
# interpreter's cast truncates).
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2**-7 + 1e-5, 1e-4),
    torch.float16: (2**-10 + 1e-5, 1e-4),
}


def operands(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    want = torch.nn.functional.linear(x.double(), w.double(), b.double() if b is not None else None)
    assert y.dtype == x.dtype and y.shape == want.shape
    rtol, atol = TOL[x.dtype]
    torch.testing.assert_close(y.double(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_rows(m: int, dtype: torch.dtype) -> None:
    """One to four rows; N and K not multiples of the tiles (masked tails), K past one tile."""
    x, w, b = operands(m, 37, 1024 + 93, dtype, bias=m % 2 == 1, seed=m)
    check(tk.gemv(x, w, b), x, w, b)


@pytest.mark.parametrize("config", [(8, 64, 4), (16, 128, 4), (4, 256, 2), (32, 32, 8)])
def test_gemv_configs(config: tuple[int, int, int]) -> None:
    """Every tiling the benchmark sweeps gives the same product."""
    x, w, b = operands(2, 100, 300, torch.float32, bias=True, seed=5)
    check(tk.gemv(x, w, b, config), x, w, b)


def test_gemv_strided_rows() -> None:
    """x's rows a slice of a wider tensor (attention's output view, a fused projection's part)."""
    wide = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    x = wide[:, 16:80]
    w = torch.randn(50, 64, generator=torch.Generator().manual_seed(2))
    check(tk.gemv(x, w), x, w, None)


def test_linear_facade_takes_one_row_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.linear: the kernel for a one-row step, torch's matmul for more rows (and for none); same products."""
    import tinypaged.kernels

    calls = []
    kernel = tinypaged.kernels.gemv
    monkeypatch.setattr(tinypaged.kernels, "gemv", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    for m in (0, 1, 2, tk.gemv_max_rows, 16):
        x, w, b = operands(m, 24, 40, torch.float32, bias=True, seed=m)
        check(ops.linear(x, w, b), x, w, b)
    assert calls == [1]


@pytest.mark.parametrize("env, want", [(None, ["cublaslt"]), ("cublaslt", ["cublaslt"]), ("cublas", [])])
def test_cublaslt_preferred_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch, env: str | None, want: list[str]
) -> None:
    """ops.prefer_cublaslt (called by a CUDA model runner) switches torch's matmuls to cuBLASLt;
    TINYPAGED_BLAS=cublas leaves torch's default alone."""
    calls: list[str] = []
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", calls.append)
    if env is None:
        monkeypatch.delenv("TINYPAGED_BLAS", raising=False)
    else:
        monkeypatch.setenv("TINYPAGED_BLAS", env)
    ops.prefer_cublaslt()
    assert calls == want
