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
