"""The FP8 matmul for small and middle batches against the float64 product of its dequantized operands, and its
unscaled form for a few bf16 or fp16 rows (`skinny_matmul`) against the float64 product."""

from __future__ import annotations

import pytest
import torch

from tinypaged.kernels.fp8_gemm import default_config, fp8_gemm, skinny_config, skinny_matmul, split_k
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
    """bf16 output rounds once at the store; every tiling, transposed (row tiles under 64) or not, split along K
    or not, gives the same sums up to their order."""
    xq, xs, wq, ws, bias = operands(20, 72, 256, seed=3)
    ref = want(xq, xs, wq, ws, bias)
    tilings = [
        (16, 32, 64, 4, 2, 0),
        (32, 64, 128, 4, 3, 0),
        (16, 128, 64, 4, 2, 128),
        (64, 128, 256, 8, 4, 0),
    ]
    for c in tilings:
        y = fp8_gemm(xq, xs, wq, ws, bias, config=c)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("m, n, k, k_split", [(1, 40, 448, 128), (20, 72, 600, 256), (40, 33, 320, 64)])
def test_split_k_is_deterministic_and_leaves_counters_zero(m: int, n: int, k: int, k_split: int) -> None:
    """K cut into pieces (the last one short): each tile's partials added in piece order by its last program,
    the same bits on every launch and for a row alone as within the batch, the tile counters back at zero."""
    from tinypaged.kernels import fp8_gemm as module

    xq, xs, wq, ws, bias = operands(m, n, k, seed=k)
    block_m = 64 if m > 32 else 16
    cfg = (block_m, 32, min(k_split, 128), 4, 2, k_split)
    y = fp8_gemm(xq, xs, wq, ws, bias, torch.float32, cfg)
    torch.testing.assert_close(y.double(), want(xq, xs, wq, ws, bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(y, fp8_gemm(xq, xs, wq, ws, bias, torch.float32, cfg))
    alone = fp8_gemm(xq[:1].clone(), xs[:1].clone(), wq, ws, bias, torch.float32, (16, *cfg[1:]))
    assert torch.equal(alone[0], y[0])
    assert not any(c.any() for c in module._counters.values())


def test_default_config_transposes_small_row_counts() -> None:
    """Up to 32 rows the tile is transposed (a row tile under 64: the weight rows on the tensor cores' 64-row
    side), K stepped 256 columns at a time but on the wide layers; then 64-row tiles, and from 65 rows 128-row
    tiles of eight warps, 128 columns on the wide layers."""
    assert default_config(1, 28672, 4096)[:5] == (16, 64, 128, 4, 3)
    assert default_config(8, 4096, 14336)[:5] == (16, 64, 256, 4, 5)
    assert default_config(32, 6144, 4096)[:5] == (32, 64, 256, 4, 5)
    assert default_config(64, 28672, 4096)[:5] == (64, 64, 128, 4, 3)
    assert default_config(200, 28672, 4096)[:5] == (128, 128, 128, 8, 3)
    assert default_config(256, 4096, 4096)[:5] == (128, 64, 128, 8, 5)


def test_split_k_follows_the_layer_not_the_row_count() -> None:
    """`split_k` cuts the 4,096-row layers (64 tiles of 64 rows) for about two programs a multiprocessor, or one;
    the wide ones not at all. Up to 32 rows the default takes one a multiprocessor in 256-column steps (QKV
    whole, O and down in two pieces), the same piece length at every row count."""
    assert split_k(28672, 4096) == 0 and split_k(14336, 4096) == 0
    assert split_k(4096, 4096) == 1024 and split_k(4096, 14336) == 3584 and split_k(6144, 4096) == 1408
    assert split_k(4096, 14336, block_k=256, programs_per_sm=1) == 7168
    assert {default_config(m, 4096, 14336)[5] for m in (1, 5, 16, 17, 32)} == {7168}
    assert default_config(3, 4096, 4096)[5] == 2048 and default_config(3, 6144, 4096)[5] == 0
    assert default_config(64, 4096, 4096)[5] == 2048 and default_config(128, 6144, 4096)[5] == 0


@pytest.mark.parametrize("m, n, k, k_split", [(5, 48, 200, 0), (16, 72, 600, 256), (3, 33, 320, 64)])
def test_skinny_matmul_matches_product_and_a_row_alone(m: int, n: int, k: int, k_split: int) -> None:
    """Few rows, split along K or not: within the rounding of the one store of the float32 sums, and a row alone
    gets the same bits as within the batch (what lets a verification's rows equal decode's). In fp16: Triton's
    interpreter runs a bf16 dot on the raw bits (the H200 benchmark checks bf16, `skinny_matmul.py`)."""
    dtype = torch.float16
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    cfg = (16, 32, min(k_split, 128) or 64, 4, 2, k_split)
    for b in (None, bias):
        y = skinny_matmul(x, w, b, config=cfg)
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        assert y.dtype == dtype and y.shape == (m, n)
        torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=2e-3)
        assert torch.equal(skinny_matmul(x[2:3].clone(), w, b, config=cfg)[0], y[2])


def test_skinny_config_splits_for_one_program_a_multiprocessor() -> None:
    """bf16 at 1-16 rows (run 94's sweep): QKV and the wide layers whole, O and down_proj in two pieces, the
    same tile and split at every row count up to 16; four stages on the wide layers, five elsewhere."""
    assert {skinny_config(m, 6144, 4096) for m in (1, 5, 16)} == {(16, 64, 128, 4, 5, 0)}
    assert skinny_config(5, 4096, 4096) == (16, 64, 128, 4, 5, 2048)
    assert skinny_config(16, 4096, 14336) == (16, 64, 128, 4, 5, 7168)
    assert skinny_config(8, 28672, 4096) == (16, 64, 128, 4, 4, 0)
    assert skinny_config(2, 128256, 4096)[4:] == (4, 0)
