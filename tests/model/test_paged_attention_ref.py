"""The paged reference attention equals a contiguous causal computation, for ragged batches and block sizes."""

import math

import pytest
import torch
import torch.nn.functional as F

from tinypaged import ops
from tinypaged.model.llama import rope_cos_sin_cache


def _contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last q.shape[0] positions of k/v `[L, Hkv, D]`, GQA by repeating kv heads."""
    n, hq, _ = q.shape
    length, hkv, _ = k.shape
    rep = hq // hkv
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    qpos = torch.arange(length - n, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
def test_paged_equals_contiguous(block_size: int, hq: int, hkv: int) -> None:
    g = torch.Generator().manual_seed(block_size * 100 + hq * 10 + hkv)
    d = 32
    # (context length, new tokens): a decode, a whole prompt, a chunk after cached context, partial blocks.
    shapes = [(1, 1), (37, 37), (50, 13), (17, 1), (16, 16), (64, 1)]
    num_blocks = sum(math.ceil(n / block_size) for n, _ in shapes) + 5
    kv_layer = torch.randn(2, num_blocks, block_size, hkv, d, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()  # non-contiguous block tables
    width = max(math.ceil(n / block_size) for n, _ in shapes)
    tables, qs, ks, vs, starts = [], [], [], [], [0]
    for length, new in shapes:
        nb = math.ceil(length / block_size)
        table = [free.pop() for _ in range(nb)]
        k = torch.randn(length, hkv, d, generator=g)
        v = torch.randn(length, hkv, d, generator=g)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
        ops.ref_write_kv(k, v, kv_layer, slots)
        tables.append(table + [0] * (width - nb))
        qs.append(torch.randn(new, hq, d, generator=g))
        ks.append(k)
        vs.append(v)
        starts.append(starts[-1] + new)
    q = torch.cat(qs)
    scale = d**-0.5
    out = ops.ref_paged_attention(
        q,
        kv_layer,
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor([n for n, _ in shapes], dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        scale,
    )
    for i in range(len(shapes)):
        want = _contiguous(qs[i], ks[i], vs[i], scale)
        got = out[starts[i] : starts[i + 1]].double()
        assert torch.allclose(got, want, atol=1e-5), (i, (got - want).abs().max())


def test_write_kv_skips_negative_slots() -> None:
    kv = torch.randn(2, 4, 8, 2, 16)
    before = kv.clone()
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    ops.ref_write_kv(k, v, kv, torch.tensor([5, -1, 17]))
    flat = kv.flatten(1, 2)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 17], v[2])
    changed = (kv != before).flatten(1, 2).any(dim=-1).any(dim=-1).any(dim=0)
    assert changed.nonzero().flatten().tolist() == [5, 17]


def test_copy_blocks_all_layers() -> None:
    cache = torch.randn(3, 2, 6, 4, 2, 8)
    before = cache.clone()
    ops.ref_copy_blocks(cache, torch.tensor([[0, 3], [2, 5]]))
    assert torch.equal(cache[:, :, 3], before[:, :, 0]) and torch.equal(cache[:, :, 5], before[:, :, 2])
    assert torch.equal(cache[:, :, :3], before[:, :, :3])
    assert torch.equal(cache[:, :, 4], before[:, :, 4])
    assert F.mse_loss(cache, before) > 0


def test_cpu_linear_in_slices_matches_whole() -> None:
    """`ops.linear` on the CPU runs a large float32 weight (the LM head) at 4-12 rows in slices of output rows:
    the same product as F.linear, to float32 rounding, at every row count around the range."""
    torch.manual_seed(0)
    w = torch.randn(8 * ops._CPU_SLICE + 7, 64)
    for rows in (1, 3, 4, 5, 12, 13):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(ops.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert ops._sliced_on_cpu(torch.randn(5, 64), w, None)
    assert not ops._sliced_on_cpu(torch.randn(5, 64), w.t().contiguous().t(), None)  # a strided view: whole
    assert not ops._sliced_on_cpu(torch.randn(5, 64), w[:1024], None)  # small: whole


@pytest.mark.parametrize("tokens", [1, 3])
def test_rotary_joins_q_and_k_of_the_fused_projection(tokens: int) -> None:
    """q and k as slices of one qkv row are rotated as one view, a single token's too (the CPU's decode step:
    views of the slices carry different row strides there), with the values of rotating each alone."""
    hq, hkv, d = 4, 2, 8
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(tokens, hq, d), k.view(tokens, hkv, d)
    joined = ops._heads_together(q, k)
    assert joined is not None and joined.shape == (tokens, hq + hkv, d)
    assert torch.equal(joined, torch.cat([q, k], 1))
    cache = rope_cos_sin_cache(d, 10000.0, None, 16, torch.device("cpu"))
    positions = torch.arange(5, 5 + tokens)
    rq, rk = ops.ref_rotary_embedding(positions, q, k, cache)
    assert rq.data_ptr() == rk.data_ptr() - hq * d * 4  # one rotation, split again
    aq, ak = ops.ref_rotary_embedding(positions, q.clone(), k.clone(), cache)  # apart: rotated one by one
    assert torch.equal(rq, aq) and torch.equal(rk, ak)
