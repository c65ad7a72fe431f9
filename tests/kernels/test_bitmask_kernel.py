"""The token bitmask kernel against `ref_apply_token_bitmask` (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from tinypaged import kernels as tk
from tinypaged import ops


@pytest.mark.parametrize(
    ("dtype", "vocab"), [(torch.float32, 5000), (torch.float16, 4099), (torch.float32, 64)]
)
def test_apply_token_bitmask(dtype: torch.dtype, vocab: int) -> None:
    """Random bits over some rows of random logits (others untouched; a vocabulary that is not a multiple of 32
    nor of the kernel's block); the kernel writes exactly what the reference writes."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=gen).to(dtype)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = 0  # nothing allowed
    bitmask[2, 0] = 1  # the low bit of a word: token 0
    rows = torch.tensor([5, 0, 2], dtype=torch.int32)
    expected = logits.clone()
    ops.ref_apply_token_bitmask(expected, bitmask, rows)
    got = logits.clone()
    tk.apply_token_bitmask(got, bitmask, rows)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    # The reference's meaning, bit by bit, on one row.
    bits = [(int(bitmask[0, j // 32]) >> (j % 32)) & 1 for j in range(vocab)]
    assert [bool(torch.isinf(expected[5, j])) for j in range(vocab)] == [b == 0 for b in bits]
    assert torch.equal(expected[[1, 3, 4, 6]], logits[[1, 3, 4, 6]])
    assert torch.isinf(expected[0]).all() and not torch.isinf(expected[2, 0])
