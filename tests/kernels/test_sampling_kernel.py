"""The sort-free sampling kernel against `ref_sample` (Triton interpreter): the same tokens from the same keys,
over every filter, flat and peaked rows, banned tokens, a row with nothing left, and rows spanning blocks.
(The reference's distribution is tested against an independent sort-based one in tests/engine/test_sampler.py.)
"""

from __future__ import annotations

import pytest
import torch

from tinypaged import kernels as tk
from tinypaged import ops


def _params(n: int, vocab: int, gen: torch.Generator) -> ops.SampleParams:
    """Temperature (every 7th row greedy), top-k (off, small, at or past the vocabulary), top-p (every 3rd
    row off, some tiny), min-p (every other row off) and keys."""
    temp = torch.rand(n, generator=gen) * 1.5 + 0.05
    temp[::7] = 0.0
    top_k = torch.randint(0, 40, (n,), generator=gen)
    top_k[1::5] = vocab
    top_k[2::5] = vocab + 7
    top_p = torch.rand(n, generator=gen).clamp(min=0.02)
    top_p[::3] = 1.0
    top_p[4::9] = 1e-6
    min_p = torch.rand(n, generator=gen) * 0.3
    min_p[::2] = 0.0
    keys = torch.randint(0, 1 << 62, (n,), generator=gen)
    return ops.SampleParams(temp, top_k, top_p, min_p, keys)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,vocab", [(40, 300), (6, 2500)], ids=["one-block", "across-blocks"])
def test_kernel_draws_what_the_reference_draws(dtype: torch.dtype, n: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab + n)
    scale = torch.rand(n, 1, generator=gen) * 6  # near-flat to peaked rows
    logits = (torch.randn(n, vocab, generator=gen) * scale).to(dtype)
    logits[3, : vocab // 2] = float("-inf")  # banned tokens
    logits[5] = float("-inf")  # nothing left: no token is valid (the sampler flags it), the draw still ends
    params = _params(n, vocab, gen)
    got = tk.sample(logits, params, ops.SAMPLE_MAX_ROUNDS)
    want = ops.ref_sample(logits, params)
    assert got.dtype == want.dtype == torch.int64
    same = (got == want).float().mean().item()
    assert same >= 0.97, (same, got.tolist(), want.tolist())  # rounding may flip a rare boundary draw
    sampled = params.temperature > 0
    assert (got[~sampled] == 0).all()
    assert (got[3][sampled[3]] >= vocab // 2).all()  # never a banned token


def test_seeded_keys_repeat_and_differ() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 500, generator=gen).repeat(4, 1)
    temp, top_k, top_p, min_p = (torch.full((4,), v) for v in (1.0, 0.0, 0.9, 0.0))
    keys = torch.tensor([11, 11, 12, 13])
    params = ops.SampleParams(temp, top_k.long(), top_p, min_p, keys)
    got = tk.sample(logits, params, ops.SAMPLE_MAX_ROUNDS).tolist()
    assert got[0] == got[1]
    assert len(set(got)) >= 2
