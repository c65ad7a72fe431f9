"""Rotary embedding kernel against `ref_rotary_embedding` (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from tinypaged import kernels as tk
from tinypaged import ops


def cos_sin_cache(max_pos: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """`[max_pos, D]` fp32: cos of the neox angles in the first half, sin in the second."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


CASES = [(torch.float32, 64, (6, 2)), (torch.float16, 128, (9, 3))]


@pytest.mark.parametrize(("dtype", "head_dim", "heads"), CASES)
def test_rotary(dtype: torch.dtype, head_dim: int, heads: tuple[int, int]) -> None:
    """q and k as strided views of one fused qkv tensor, at random positions."""
    n_q, n_kv = heads
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(11, n_q + 2 * n_kv, head_dim, generator=gen).to(dtype)
    q, k = qkv[:, :n_q], qkv[:, n_q : n_q + n_kv]
    positions = torch.randint(0, 500, (11,), generator=gen)
    cache = cos_sin_cache(512, head_dim)
    q_out, k_out = tk.rotary_embedding(positions, q, k, cache)
    q_ref, k_ref = ops.ref_rotary_embedding(positions, q, k, cache)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(q_out, q_ref, atol=tol, rtol=0)
    torch.testing.assert_close(k_out, k_ref, atol=tol, rtol=0)
    q_fac, k_fac = ops.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(q_fac, q_out, atol=0, rtol=0)


@pytest.mark.parametrize(("dtype", "head_dim", "heads"), CASES)
def test_rotary_write_kv(dtype: torch.dtype, head_dim: int, heads: tuple[int, int]) -> None:
    """The fused rotary + KV write: q as the rotary gives it, the cache as the rotary then the write leave it;
    negative slots (padding) write nothing."""
    n_q, n_kv = heads
    gen = torch.Generator().manual_seed(head_dim + 1)
    qkv = torch.randn(11, n_q + 2 * n_kv, head_dim, generator=gen).to(dtype)
    q, k, v = qkv[:, :n_q], qkv[:, n_q : n_q + n_kv], qkv[:, n_q + n_kv :]
    positions = torch.randint(0, 500, (11,), generator=gen)
    cache = cos_sin_cache(512, head_dim)
    kv = torch.randn(2, 6, 4, n_kv, head_dim, generator=gen).to(dtype)  # 6 blocks of 4 slots
    slots = torch.randperm(24, generator=gen)[:11].to(torch.int32)
    slots[[2, 7]] = -1
    want_kv = kv.clone()
    want_q = ops.ref_rotary_write_kv(positions, q, k, v, cache, want_kv, slots)
    got_kv = kv.clone()
    got_q = tk.rotary_write_kv(positions, q, k, v, cache, got_kv, slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=0)
    torch.testing.assert_close(got_kv, want_kv, atol=tol, rtol=0)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots[slots >= 0].long()] = False
    assert got_kv.flatten(1, 2)[:, untouched].equal(kv.flatten(1, 2)[:, untouched])


@pytest.mark.parametrize(
    ("dtype", "weight_dtype", "head_dim"),
    [
        (torch.float32, torch.float32, 64),
        (torch.float16, torch.float16, 32),
        (torch.float16, torch.float32, 80),
    ],
)
def test_rotary_write_kv_with_qk_norm(dtype: torch.dtype, weight_dtype: torch.dtype, head_dim: int) -> None:
    """Per-head q/k RMSNorm in the same launch (Qwen3's weights in the model's dtype; Gemma 3's 1 + w kept in
    float32; a head_dim that is no power of two): as `ref_rms_norm` of each head's row, rounded to the model's
    dtype, then the rotary and the write; q and k on strided views of one qkv row, as the model passes them."""
    n_q, n_kv = 4, 2
    gen = torch.Generator().manual_seed(head_dim)
    qkv = (torch.randn(9, n_q + 2 * n_kv, head_dim, generator=gen) * 3).to(dtype)
    q, k, v = qkv[:, :n_q], qkv[:, n_q : n_q + n_kv], qkv[:, n_q + n_kv :]
    norms = (
        (torch.rand(head_dim, generator=gen) + 0.5).to(weight_dtype),
        (torch.rand(head_dim, generator=gen) + 0.5).to(weight_dtype),
        1e-6,
    )
    positions = torch.randint(0, 500, (9,), generator=gen)
    cache = cos_sin_cache(512, head_dim)
    kv = torch.zeros(2, 4, 4, n_kv, head_dim, dtype=dtype)
    slots = torch.randperm(16, generator=gen)[:9].to(torch.int32)
    want_kv, got_kv = kv.clone(), kv.clone()
    want_q = ops.ref_rotary_write_kv(positions, q, k, v, cache, want_kv, slots, qk_norm=norms)
    got_q = tk.rotary_write_kv(positions, q, k, v, cache, got_kv, slots, qk_norm=norms)
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=0)
    torch.testing.assert_close(got_kv, want_kv, atol=tol, rtol=0)
    plain = ops.ref_rotary_write_kv(positions, q, k, v, cache, kv.clone(), slots)
    assert (plain - want_q).abs().max() > 0.1  # the norm did something


@pytest.mark.parametrize(("dtype", "scales"), [(torch.float32, (1.0, 1.0)), (torch.float16, (0.05, 3.0))])
def test_rotary_write_kv_fp8(dtype: torch.dtype, scales: tuple[float, float]) -> None:
    """Into an FP8 cache: the bytes of the reference's rotary (rounded to the model's dtype) then quantization
    with the layer's scales; q as without FP8."""
    n_q, n_kv, head_dim = 6, 2, 64
    gen = torch.Generator().manual_seed(2)
    qkv = (torch.randn(11, n_q + 2 * n_kv, head_dim, generator=gen) * 4).to(dtype)
    q, k, v = qkv[:, :n_q], qkv[:, n_q : n_q + n_kv], qkv[:, n_q + n_kv :]
    positions = torch.randint(0, 500, (11,), generator=gen)
    cache = cos_sin_cache(512, head_dim)
    kv = torch.randn(2, 6, 4, n_kv, head_dim, generator=gen).to(torch.float8_e4m3fn)
    slots = torch.randperm(24, generator=gen)[:11].to(torch.int32)
    slots[[2, 7]] = -1
    want_kv = kv.clone()
    want_q = ops.ref_rotary_write_kv(positions, q, k, v, cache, want_kv, slots, *scales)
    got_q = ops.rotary_write_kv(positions, q, k, v, cache, kv, slots, *scales)
    torch.testing.assert_close(got_q, want_q, atol=1e-5 if dtype == torch.float32 else 2e-3, rtol=0)
    diff = kv.view(torch.uint8).int() - want_kv.view(torch.uint8).int()
    # An fp16 rotation may differ from torch's in its last bit, which can move it to the neighbouring E4M3 value.
    assert diff.abs().max() <= (0 if dtype == torch.float32 else 1) and diff.count_nonzero() <= 4
