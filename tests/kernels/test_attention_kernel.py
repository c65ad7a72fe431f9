"""Paged attention kernel against `ref_paged_attention` on small ragged batches (Triton interpreter), over caches in
the query's dtype and in FP8 with scales."""

from __future__ import annotations

import pytest
import torch

from tinypaged import kernels as tk
from tinypaged import ops

attention = tk.attention
AttnConfig = attention.AttnConfig


def make_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    num_kv_heads: int,
    g: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    """Random q and cache; shuffled block tables padded with -1 (never to be read) and spare blocks."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_per_seq) + 2
    num_blocks = sum(blocks_per_seq) + 5
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(q_lens), width), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used : used + n]
        used += n
    q = torch.randn(sum(q_lens), num_kv_heads * g, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, kv, block_tables, torch.tensor(seq_lens, dtype=torch.int32), query_start_loc


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Every element written, and the relative error within the dtype's rounding."""
    assert not out.isnan().any(), "unwritten or NaN output"
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < (1e-5 if out.dtype == torch.float32 else 3e-3), err


def run(q, kv, block_tables, seq_lens, query_start_loc, **kwargs) -> torch.Tensor:
    """The kernel with a NaN-poisoned output, and the reference."""
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    attention.paged_attention(q, kv, block_tables, seq_lens, query_start_loc, scale, out=out, **kwargs)
    check(out, ops.ref_paged_attention(q, kv, block_tables, seq_lens, query_start_loc, scale))
    return out


# (G, head_dim, block_size, dtype, KV splits for the decode rows)
MIXED = [
    (1, 64, 8, torch.float32, 1),
    (3, 64, 16, torch.float16, 2),
    (4, 128, 16, torch.float16, 1),
    (4, 128, 32, torch.float32, 3),
    (8, 64, 32, torch.float16, 4),
    (8, 128, 8, torch.float32, 1),
]


@pytest.mark.parametrize(("g", "head_dim", "block_size", "dtype", "splits"), MIXED)
def test_mixed_batch(g: int, head_dim: int, block_size: int, dtype: torch.dtype, splits: int) -> None:
    """Decodes, fresh prefills, chunked prefills over cached context, and partial last blocks in one batch."""
    q_lens = [1, 9, 1, 23, 4, 1]
    ctx_lens = [37, 0, 5, 18, 50, 0]
    batch = make_batch(q_lens, ctx_lens, 2, g, head_dim, block_size, dtype, seed=g * head_dim + block_size)
    run(*batch, num_kv_splits=splits)


@pytest.mark.parametrize(("g", "splits"), [(1, 1), (4, 1), (4, 2), (3, 5), (8, 3)])
def test_decode_only(g: int, splits: int) -> None:
    """Single-token queries with split-KV on and off, including splits left empty by short sequences."""
    ctx_lens = [0, 15, 16, 70, 33]
    batch = make_batch([1] * 5, ctx_lens, 2, g, 64, 16, torch.float16, seed=splits + 10 * g)
    run(*batch, num_kv_splits=splits, max_query_len=1, max_seq_len=71)


@pytest.mark.parametrize(
    ("q_lens", "ctx_lens", "splits"),
    [
        ([1] * 5, [5, 70, 0, 33, 16], 1),
        ([1] * 5, [5, 70, 0, 33, 16], 3),
        ([1, 9, 1, 23, 1], [37, 0, 5, 18, 60], 2),
    ],
)
def test_decode_order(q_lens: list[int], ctx_lens: list[int], splits: int) -> None:
    """Decode programs that take the sequences longest first (`seq_order`, as the engine stages it) write the
    same rows, bit for bit: the order schedules the programs and changes nothing they compute."""
    q, kv, bt, seq_lens, qsl = make_batch(q_lens, ctx_lens, 2, 4, 64, 16, torch.float32, seed=splits)
    order = torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
    assert order.tolist() != list(range(len(q_lens)))
    plain = run(q, kv, bt, seq_lens, qsl, num_kv_splits=splits)
    ordered = run(q, kv, bt, seq_lens, qsl, num_kv_splits=splits, seq_order=order)
    assert torch.equal(plain, ordered)


@pytest.mark.parametrize("g", [1, 4])
def test_prefill_tiles(g: int) -> None:
    """Small tiles so that each sequence spans several query blocks and KV tiles, with and without context."""
    q_lens = [40, 3, 17]
    ctx_lens = [0, 29, 45]
    batch = make_batch(q_lens, ctx_lens, 2, g, 64, 8, torch.float32, seed=g)
    configs = (AttnConfig(16, 16), AttnConfig(16, 16))
    run(*batch, configs=configs, max_query_len=40, max_seq_len=62)


def test_hints_and_strided_q() -> None:
    """q as a strided view of a fused qkv tensor; the launch hints change nothing."""
    q_lens, ctx_lens = [5, 1, 12], [3, 20, 0]
    q, kv, bt, seq_lens, qsl = make_batch(q_lens, ctx_lens, 2, 4, 64, 16, torch.float16, seed=7)
    qkv = torch.randn(q.shape[0], 12, 64).to(torch.float16)
    qkv[:, :8] = q
    a = run(qkv[:, :8], kv, bt, seq_lens, qsl)
    b = run(qkv[:, :8], kv, bt, seq_lens, qsl, max_query_len=12, max_seq_len=32, num_kv_splits=2)
    torch.testing.assert_close(a, b, atol=2e-3, rtol=0)


def test_facade() -> None:
    """`ops.paged_attention` routes to the kernel under the interpreter with the signature it calls."""
    q, kv, bt, seq_lens, qsl = make_batch([2, 1], [6, 9], 1, 3, 64, 8, torch.float32, seed=3)
    out = ops.paged_attention(q, kv, bt, seq_lens, qsl, 0.2)
    check(out, ops.ref_paged_attention(q, kv, bt, seq_lens, qsl, 0.2))


@pytest.mark.parametrize(
    ("q_lens", "ctx_lens", "splits"), [([1, 9, 1, 23], [37, 0, 5, 18], 2), ([1, 1], [12, 40], 3)]
)
def test_padded_as_a_cuda_graph(q_lens: list[int], ctx_lens: list[int], splits: int) -> None:
    """The layout of a mixed-step CUDA graph: the batch's rows padded with sequences of no tokens and no
    context, its tokens with rows of no sequence, and the graph's token count as max_query_len. The real rows
    equal the unpadded batch's; the padding is neither read nor a cause of errors."""
    q, kv, bt, seq_lens, qsl = make_batch(q_lens, ctx_lens, 2, 4, 64, 16, torch.float32, seed=len(q_lens))
    want = run(q, kv, bt, seq_lens, qsl, num_kv_splits=splits)
    n_tok, n_seq = q.shape[0], len(q_lens)
    pad_tok, pad_seq = n_tok + 13, n_seq + 6
    q_pad = torch.cat([q, torch.randn(pad_tok - n_tok, *q.shape[1:])])
    bt_pad = torch.cat([bt, torch.full((pad_seq - n_seq, bt.shape[1]), -1, dtype=torch.int32)])
    lens_pad = torch.cat([seq_lens, torch.zeros(pad_seq - n_seq, dtype=torch.int32)])
    qsl_pad = torch.cat([qsl, torch.full((pad_seq - n_seq,), n_tok, dtype=torch.int32)])
    out = torch.full_like(q_pad, float("nan"))
    scale = q.shape[-1] ** -0.5
    attention.paged_attention(
        q_pad, kv, bt_pad, lens_pad, qsl_pad, scale, max_query_len=pad_tok, max_seq_len=64,
        num_kv_splits=splits, out=out,
    )  # fmt: skip
    torch.testing.assert_close(out[:n_tok], want, atol=1e-5, rtol=0)
    assert out[n_tok:].isnan().all(), "a padding token's row was written"


@pytest.mark.parametrize(("g", "splits", "short"), [(4, 1, 5), (4, 3, 5), (2, 2, 3), (1, 4, 8)])
def test_short_queries_in_the_decode_launch(g: int, splits: int, short: int) -> None:
    """`short_query_len` (a verification's k + 1): sequences with up to that many new tokens go to the decode
    launch, split over the context, longer ones to the prefill launch; causal within the new tokens, the same
    outputs as the reference; as one batch and padded as a mixed-step CUDA graph (max_query_len the token
    count), and with every sequence short (no prefill launch)."""
    q_lens, ctx_lens = [1, short, short - 1, short + 4, 2], [37, 21, 0, 18, 50]
    batch = make_batch(q_lens, ctx_lens, 2, g, 64, 16, torch.float32, seed=g + splits)
    run(*batch, num_kv_splits=splits, short_query_len=short)
    run(*batch, num_kv_splits=splits, short_query_len=short, max_query_len=sum(q_lens), max_seq_len=80)
    few = make_batch([short, 1, short - 1], [9, 30, 4], 2, g, 64, 8, torch.float32, seed=splits)
    run(*few, num_kv_splits=splits, short_query_len=short)


@pytest.mark.parametrize(("short", "splits"), [(5, 1), (5, 3), (1, 2)])
def test_graph_rows_past_the_tokens(short: int, splits: int) -> None:
    """A mixed-step graph of 16 tokens keeps 40 sequence rows (max_num_seqs), most with no tokens, last in row
    order and in the longest-first decode order: both launches (and the reduce) cover the first 16 sequences
    only, and every real row still equals the unpadded batch's (a verification of `short` tokens or a decode
    beside a prefill chunk)."""
    q_lens = [short, 1, short + 3] if short > 1 else [1, 6, 1]
    q, kv, bt, seq_lens, qsl = make_batch(q_lens, [30, 70, 9], 2, 4, 64, 16, torch.float32, seed=splits)
    want = run(q, kv, bt, seq_lens, qsl, num_kv_splits=splits, short_query_len=short)
    n_tok, n_seq, pad_tok, pad_seq = q.shape[0], len(q_lens), 16, 40
    q_pad = torch.cat([q, torch.randn(pad_tok - n_tok, *q.shape[1:])])
    bt_pad = torch.cat([bt, torch.full((pad_seq - n_seq, bt.shape[1]), -1, dtype=torch.int32)])
    lens_pad = torch.cat([seq_lens, torch.zeros(pad_seq - n_seq, dtype=torch.int32)])
    qsl_pad = torch.cat([qsl, torch.full((pad_seq - n_seq,), n_tok, dtype=torch.int32)])
    order = torch.cat([torch.argsort(-seq_lens, stable=True), torch.arange(n_seq, pad_seq)]).to(torch.int32)
    out = torch.full_like(q_pad, float("nan"))
    attention.paged_attention(
        q_pad, kv, bt_pad, lens_pad, qsl_pad, q.shape[-1] ** -0.5, max_query_len=pad_tok, max_seq_len=96,
        num_kv_splits=splits, seq_order=order, short_query_len=short, out=out,
    )  # fmt: skip
    torch.testing.assert_close(out[:n_tok], want, atol=1e-5, rtol=0)
    assert out[n_tok:].isnan().all(), "a padding token's row was written"


@pytest.mark.parametrize(
    ("programs", "max_splits", "want"),
    [
        (2048, 64, 1),
        (528, 64, 1),
        (1600, 8, 1),
        (512, 64, 2),
        (256, 64, 2),
        (64, 64, 8),
        (8, 64, 64),
        (8, 8, 8),
    ],
)
def test_split_choice(programs: int, max_splits: int, want: int) -> None:
    """Decode splits on an H200 (528 program slots): none from a wave of programs up (the longest-first order
    balances them), else the most that fit one wave, two at least, within the cap of 4 tiles a split."""
    from tinypaged.kernels.attention_configs import splits_for_programs

    assert splits_for_programs(programs, 528, max_splits) == want


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_padding_rows_are_zeros(splits: int) -> None:
    """A decode graph's padding rows (context length 0, one query token, slot -1) see no key: their output is
    zeros with split-KV too (its reduce must not divide 0 by 0), and the real rows are as without them."""
    q, kv, bt, seq_lens, qsl = make_batch([1] * 3, [20, 45, 7], 2, 4, 64, 16, torch.float32, seed=splits)
    real = run(q, kv, bt, seq_lens, qsl, num_kv_splits=splits)
    pad = 2
    q_pad = torch.cat([q, torch.randn(pad, *q.shape[1:], generator=torch.Generator().manual_seed(splits))])
    bt_pad = torch.cat([bt, torch.zeros(pad, bt.shape[1], dtype=bt.dtype)])
    lens_pad = torch.cat([seq_lens, torch.zeros(pad, dtype=seq_lens.dtype)])
    qsl_pad = torch.arange(len(lens_pad) + 1, dtype=torch.int32)
    out = torch.full_like(q_pad, float("nan"))
    scale = q.shape[-1] ** -0.5
    attention.paged_attention(q_pad, kv, bt_pad, lens_pad, qsl_pad, scale, out=out, num_kv_splits=splits)
    assert (out[3:] == 0).all()
    torch.testing.assert_close(out[:3], real, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("q_lens", "ctx_lens", "g", "dtype", "splits"),
    [
        ([1, 9, 1, 23, 4], [37, 0, 5, 18, 50], 4, torch.float32, 1),  # prefill chunks beside decodes, GQA
        ([1, 9, 1, 23, 4], [37, 0, 5, 18, 50], 1, torch.float16, 3),  # split-KV decodes, no GQA
        ([1, 1, 1], [70, 0, 33], 3, torch.float32, 2),  # decode only, split
        ([1, 9, 1, 23, 4], [37, 0, 5, 18, 50], 4, torch.bfloat16, 2),  # bf16 queries: the dots run in fp16
    ],
)
def test_fp8_cache(q_lens: list[int], ctx_lens: list[int], g: int, dtype: torch.dtype, splits: int) -> None:
    """An FP8 cache with scales != 1 (keys converted as they are loaded, k_scale in the softmax scale, v_scale on
    the output or the split partials) against the reference's dequantized reading."""
    q, kv, bt, seq_lens, qsl = make_batch(q_lens, ctx_lens, 2, g, 64, 8, torch.float32, seed=g + splits)
    k_scale, v_scale = 0.02, 0.01  # random keys and values of about +-4 stored up to +-200 and +-400
    cache = torch.zeros(kv.shape, dtype=torch.float8_e4m3fn)
    flat = kv.flatten(1, 2)
    ops.ref_write_kv(flat[0], flat[1], cache, torch.arange(flat.shape[1]), k_scale, v_scale)
    q, scale = q.to(dtype), q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    attention.paged_attention(q, cache, bt, seq_lens, qsl, scale, out=out, num_kv_splits=splits, **scales)
    want = ops.ref_paged_attention(q, cache, bt, seq_lens, qsl, scale, **scales)
    if (
        dtype == torch.bfloat16
    ):  # rounded twice: q and p to fp16 for the dots, the output to bf16 (truncated here)
        assert not out.isnan().any() and ((out.double() - want.double()).norm() / want.double().norm()) < 6e-3
    else:
        check(out, want)
    # The scales are read: the same bytes at scale 1 give another output.
    plain = ops.ref_paged_attention(q, cache, bt, seq_lens, qsl, scale)
    assert ((plain - want).norm() / want.norm()).item() > 0.1


@pytest.mark.parametrize(
    ("window", "g", "block_size", "dtype", "splits"),
    [
        (1, 2, 8, torch.float32, 1),
        (7, 4, 8, torch.float32, 2),
        (16, 1, 16, torch.float16, 1),
        (40, 4, 4, torch.float32, 3),
    ],
)
def test_sliding_window(window: int, g: int, block_size: int, dtype: torch.dtype, splits: int) -> None:
    """Each token sees its last `window` positions: decodes and prefill chunks over contexts longer and shorter
    than the window. The block-table entries wholly below a sequence's first visible key are -1 (freed blocks):
    never read."""
    q_lens = [1, 9, 1, 23, 4, 1, 30]
    ctx_lens = [37, 0, 5, 18, 50, 3, 70]
    q, kv, bt, seq_lens, qsl = make_batch(q_lens, ctx_lens, 2, g, 32, block_size, dtype, seed=window)
    for i, ctx in enumerate(ctx_lens):
        gone = max(ctx - window + 1, 0) // block_size  # blocks before the one holding the first visible key
        bt[i, :gone] = -1
    scale = q.shape[-1] ** -0.5
    ref = ops.ref_paged_attention(q, kv, bt, seq_lens, qsl, scale, window=window)
    full = ops.ref_paged_attention(q, kv, bt.clamp(min=0), seq_lens, qsl, scale)
    assert not torch.allclose(ref, full)  # the window binds
    for cfgs in (None, (AttnConfig(16, 16, 4, 1), AttnConfig(32, 16, 4, 1))):
        out = torch.full_like(q, float("nan"))
        attention.paged_attention(
            q, kv, bt, seq_lens, qsl, scale, out=out, num_kv_splits=splits, window=window, configs=cfgs
        )
        check(out, ref)
