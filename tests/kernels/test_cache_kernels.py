"""KV write and block copy kernels against `ref_write_kv` / `ref_copy_blocks` (Triton interpreter), an FP8 cache's
too: the bytes the kernel stores are the reference's (`model/quant/e4m3.py`'s quantize), and block moves copy them."""

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


FP8 = torch.float8_e4m3fn


def random_fp8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """An FP8 tensor of random finite values (random bytes, the two NaN codes excepted)."""
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    return raw.masked_fill_((raw & 0x7F) == 0x7F, 0).view(FP8)


@pytest.mark.parametrize(("src_dtype", "scales"), [(torch.float32, (1.0, 1.0)), (torch.float16, (0.37, 2.5))])
def test_write_kv_fp8_bytes(src_dtype: torch.dtype, scales: tuple[float, float]) -> None:
    """Values over E4M3's whole range and past it (normals, subnormals, ties, zeros of both signs, values to
    saturate) into scattered slots of an FP8 cache, some negative: every byte stored is the reference's."""
    gen = torch.Generator().manual_seed(1)
    heads, head_dim, block_size, n = 3, 32, 8, 13
    cache = random_fp8((2, 5, block_size, heads, head_dim), gen)
    kv = torch.randn(n, 2 * heads, head_dim, generator=gen) * torch.logspace(-4, 2.5, n)[:, None, None]
    special = [7.93, 0.0, -0.0, 2**-10, -3 * 2**-10, 2**-6 - 2**-12, 500.0, -1e4, 464.0, 17.0, -9.0, 0.3]
    kv.view(-1)[: len(special)] = torch.tensor(special)  # 17 and -9: half way between grid points
    kv = kv.to(src_dtype)
    key, value = kv[:, :heads], kv[:, heads:]
    slots = torch.randperm(5 * block_size, generator=gen)[:n]
    slots[[2, 7]] = -1
    want = cache.clone()
    ops.ref_write_kv(key, value, want, slots, *scales)
    assert not torch.equal(want.view(torch.uint8), cache.view(torch.uint8))
    tk.write_kv(key, value, cache, slots, *scales)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))


def test_fp8_blocks_move_as_bytes() -> None:
    """Copy-on-write copies (kernel and reference) and swaps move an FP8 cache's bytes unchanged."""
    gen = torch.Generator().manual_seed(3)
    cache = random_fp8((3, 2, 12, 8, 2, 32), gen)
    mapping = torch.tensor([[0, 5], [3, 9], [7, 1]])
    want = cache.view(torch.uint8).clone()
    want[:, :, mapping[:, 1]] = want[:, :, mapping[:, 0]]
    tk.copy_blocks(cache, mapping)
    assert torch.equal(cache.view(torch.uint8), want)
    ops.ref_copy_blocks(cache, mapping)
    assert torch.equal(cache.view(torch.uint8), want)
    swap = torch.zeros(3, 2, 4, 8, 2, 32, dtype=FP8)
    ops.swap_blocks(cache, swap, [(9, 0), (2, 3)])
    assert torch.equal(swap.view(torch.uint8)[:, :, [0, 3]], want[:, :, [9, 2]])
    ops.swap_blocks(swap, cache, [(0, 11)])
    assert torch.equal(cache.view(torch.uint8)[:, :, 11], want[:, :, 9])
