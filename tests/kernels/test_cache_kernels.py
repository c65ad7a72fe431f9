"""KV write and block copy kernels against `ref_write_kv` / `ref_copy_blocks` (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from tinypaged import kernels as tk
from tinypaged import ops


@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype", "block_size", "heads", "head_dim"),
    [
        (torch.float32, torch.float32, 8, 2, 64),
        (torch.float16, torch.float16, 16, 3, 64),
        (torch.float32, torch.float16, 32, 1, 128),
    ],
)
def test_write_kv(
    src_dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int, heads: int, head_dim: int
) -> None:
    """Scattered slots (some negative, to be skipped) into a random cache; other slots keep their values."""
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, n = 6, 13
    cache = torch.randn(2, num_blocks, block_size, heads, head_dim, generator=gen).to(cache_dtype)
    kv = torch.randn(n, 2 * heads, head_dim, generator=gen).to(src_dtype)
    key, value = kv[:, :heads], kv[:, heads:]  # strided views, as a fused projection gives them
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[[2, 7]] = -1
    expected = cache.clone()
    ops.ref_write_kv(key, value, expected, slots)
    tk.write_kv(key, value, cache, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)
    ops.write_kv(key, value, cache, slots)  # the facade's signature
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_copy_blocks(index_dtype: torch.dtype) -> None:
    """Several (src, dst) pairs across every layer, keys and values; other blocks unchanged."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 2, 12, 8, 3, 64, generator=gen).to(torch.float16)
    mapping = torch.tensor([[0, 5], [3, 9], [0, 11], [7, 1]], dtype=index_dtype)
    expected = cache.clone()
    ops.ref_copy_blocks(expected, mapping)
    tk.copy_blocks(cache, mapping)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)
    ops.copy_blocks(cache, mapping)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)
