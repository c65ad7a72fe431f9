"""The FP8 matmul for small and middle batches against the float64 product of its dequantized operands."""

from __future__ import annotations

import pytest
import torch

from tinypaged.kernels.fp8_gemm import default_config, fp8_gemm
from tinypaged.model.quant import fp8


def operands(m: int, n: int, k: int, seed: int):
    """Per-token E4M3 activations and per-channel E4M3 weights of random values, with their scales."""
    gen = torch.Generator().manual_seed(seed)
    xq, xs = fp8.quantize_per_token(torch.randn(m, k, generator=gen) * 3)
    wq, ws = fp8.quantize_per_channel(torch.randn(n, k, generator=gen) / k**0.5)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    return xq, xs, wq, ws, bias


def want(xq, xs, wq, ws, bias) -> torch.Tensor:
    y = (xq.double() * xs.double()) @ (wq.double() * ws.double()[:, None]).T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("m, n, k", [(5, 48, 200), (16, 64, 128), (33, 100, 300), (70, 40, 96)])
def test_fp8_gemm_matches_dequantized_product(m: int, n: int, k: int) -> None:
    """Row and column counts off the tiles, K past one tile and not a multiple of it; with and without bias."""
    xq, xs, wq, ws, bias = operands(m, n, k, seed=m)
    for b in (None, bias):
        y = fp8_gemm(xq, xs, wq, ws, b, out_dtype=torch.float32)
        assert y.shape == (m, n) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), want(xq, xs, wq, ws, b), rtol=1e-5, atol=1e-5)


def test_fp8_gemm_bf16_out_and_configs() -> None:
    """bf16 output rounds once at the store; every tiling, transposed (row tiles under 64) or not, gives the same
    sums (one program a tile, no split-K)."""
    xq, xs, wq, ws, bias = operands(20, 72, 256, seed=3)
    ref = want(xq, xs, wq, ws, bias)
    outs = [
        fp8_gemm(xq, xs, wq, ws, bias, config=c)
        for c in [(16, 32, 64, 4, 2), (32, 64, 128, 4, 3), (16, 128, 64, 4, 2), (64, 128, 256, 8, 4)]
    ]
    for y in outs:
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=1e-3)


def test_default_config_transposes_small_row_counts() -> None:
    """Up to 32 rows the tile is transposed (a row tile under 64: the weight rows on the tensor cores' 64-row
    side); from 33 rows 64-row tiles, the column tile narrowed when the wide one would leave multiprocessors idle."""
    assert default_config(1, 28672, 4096)[:3] == (16, 128, 128)
    assert default_config(8, 4096, 14336)[:3] == (16, 64, 128)
    assert default_config(32, 6144, 4096)[:3] == (32, 64, 128)
    assert default_config(64, 28672, 4096)[:3] == (64, 128, 128)
    assert default_config(64, 4096, 14336)[:3] == (64, 32, 128)
    assert default_config(256, 4096, 4096)[:3] == (64, 64, 128)
