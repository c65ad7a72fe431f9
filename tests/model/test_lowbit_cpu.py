"""torch's packed CPU kernels (model/quant/cpu.py) against the float32 dequantize-then-matmul reference, within
bf16's tolerance (they run in bf16: the input, the scales and zeros, and the output each rounded once), and the
int8 embedding found back from Q8_0 values: exact lookups, an LM head within the same tolerance."""

from __future__ import annotations

import pytest
import torch

from tinypaged.model.quant import cpu, lowbit

BF16 = 2.0**-8  # bf16's relative rounding (8 significant bits: half an ulp is 2^-9; three roundings, margin)


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """`got` equals `x @ w.T` within bf16's rounding of x, w's scales and the output, elementwise."""
    want = x.double() @ w.double().T
    bound = 3 * BF16 * (x.abs().double() @ w.abs().double().T) + 1e-6
    assert ((got.double() - want).abs() <= bound).all(), (got.double() - want).abs().max()


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("kind", ["sym", "asym", "mins"])
@pytest.mark.parametrize("rows", [1, 5])
def test_int4_kernel_matches_the_reference(group: int, kind: str, rows: int) -> None:
    g = torch.Generator().manual_seed(group + rows)
    n, k = 48, 256
    w = lowbit.quantize_rtn(torch.randn(n, k, generator=g), 4, group, kind == "sym")
    if kind == "mins":  # GGUF's q * d + m: codes, scales, float32 offsets, no zero point
        mins = -torch.rand(k // group, n, generator=g) * 0.1
        w = lowbit.IntWeight(w.qweight, w.scales, None, 4, group, mins)
    x = torch.randn(rows, k, generator=g)
    packed = cpu.pack(lowbit.unpack(w.qweight, 4), w.scales, w.zeros, w.mins, 4, group)
    got = lowbit.wint_linear(x, w._replace(cpu=packed))
    assert cpu.packable(4, group, n, k, kind == "asym", kind == "mins") and not cpu.packable(
        4, group, 40, k, 0, 0
    )
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    _close(got, x, lowbit.dequantize_weight(w))


def test_int8_per_row_kernel_matches_the_reference() -> None:
    g = torch.Generator().manual_seed(1)
    n, k = 40, 96
    w = lowbit.quantize_rtn(torch.randn(n, k, generator=g), 8, k, True)
    assert cpu.packable(8, k, n, k, False, False) and not cpu.packable(8, 32, n, k, False, False)
    packed = cpu.pack(lowbit.unpack(w.qweight, 8), w.scales, None, None, 8, k)
    x = torch.randn(3, k, generator=g)
    _close(lowbit.wint_linear(x, w._replace(cpu=packed)), x, lowbit.dequantize_weight(w))


@pytest.mark.parametrize("group", [16, 32, 128])
@pytest.mark.parametrize("kind", ["sym", "asym", "mins"])
@pytest.mark.parametrize("rows", [1, 5])
def test_grouped_int8_runs_split_in_nibbles_on_the_int4_kernel(group: int, kind: str, rows: int) -> None:
    """Grouped 8-bit weights (GGUF's Q8_0 / Q5_0 / Q5_1 / Q5_K, `quantization="int8"`, 8-bit GPTQ): torch has no
    grouped INT8 kernel, so each code is split in two nibbles over the input row repeated (`cpu.split_int8`)."""
    g = torch.Generator().manual_seed(group + rows)
    n, k = 48, 256
    w = lowbit.quantize_rtn(torch.randn(n, k, generator=g), 8, group, kind == "sym")
    if kind == "asym":  # zero points near the middle: every code within a byte of its zero
        zeros = torch.randint(100, 156, (k // group, n), generator=g, dtype=torch.uint8)
        z = zeros.t().int().repeat_interleave(group, 1)
        codes = (z + torch.randint(-128, 128, (n, k), generator=g)).clamp(0, 255)
        w = lowbit.IntWeight(lowbit.pack(codes.to(torch.int32), 8), w.scales, zeros, 8, group)
    if kind == "mins":  # GGUF's Q5_1: 5-bit codes, q * d + m
        codes = torch.randint(0, 32, (n, k), generator=g, dtype=torch.int32)
        mins = -torch.rand(k // group, n, generator=g) * 0.1
        w = lowbit.IntWeight(lowbit.pack(codes, 8), w.scales, None, 8, group, mins)
    x = torch.randn(rows, k, generator=g)
    packed = cpu.pack(lowbit.unpack(w.qweight, 8), w.scales, w.zeros, w.mins, 8, group)
    assert cpu.packable(8, group, n, k, kind == "asym", kind == "mins") and packed.doubled
    assert packed.padded == (group == 16)  # Q6_K's groups of 16, padded to the kernel's 32
    got = lowbit.wint_linear(x, w._replace(cpu=packed))
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    _close(got, x, lowbit.dequantize_weight(w))


def test_an_8_bit_code_past_a_byte_from_its_zero_is_not_packed() -> None:
    codes = torch.zeros(16, 32, dtype=torch.int32)
    codes[0, 0] = 255  # 255 away from its zero point 0
    zeros = torch.zeros(1, 16, dtype=torch.uint8)
    assert cpu.pack(codes, torch.ones(1, 16), zeros, None, 8, 32) is None


def _q8_0(w: torch.Tensor) -> torch.Tensor:
    """w rounded as GGUF's Q8_0 (float16 d = amax / 127 per 32 columns, signed codes), in float32."""
    blocks = w.view(w.shape[0], -1, 32)
    d = (blocks.abs().amax(-1) / 127).half().float()
    return (torch.round(blocks / d[..., None]).clamp(-127, 127) * d[..., None]).view_as(w)


def test_int8_embedding_is_exact_and_its_head_close() -> None:
    g = torch.Generator().manual_seed(2)
    w = _q8_0(torch.randn(208, 64, generator=g) * 0.1)
    w[7] = 0.0  # an all-zero row: d = 0
    emb = cpu.int8_embedding(w)
    assert emb is not None
    ids = torch.tensor([[0, 7], [207, 3]])
    assert torch.equal(emb.lookup(ids), w[ids])
    x = torch.randn(3, 64, generator=g)
    _close(emb.logits(x), x, w)
    assert cpu.int8_embedding(torch.randn(208, 64, generator=g)) is None  # not Q8_0 values: kept as it is


def test_int8_head_recomputes_its_top_logits_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's `HEAD_EXACT_TOP` largest logits a row are the float32 products of the exact weights and the
    float32 hidden row, so greedy's argmax is the f32 model's where bf16 logits tie two close tokens (without the
    recomputation it is not); the other logits are the kernel's."""
    g = torch.Generator().manual_seed(3)
    w = _q8_0(torch.randn(512, 64, generator=g) * 0.1)
    # Row 11: row 10 with one code a step up where row 10 (and so the hidden rows below) is smallest and positive:
    # its logit a hair above row 10's, far within one bf16 step.
    j = int(torch.where(w[10] > 0, w[10], torch.inf).argmin())
    w[11] = w[10]
    w[11, j] += w[10].view(-1, 32)[j // 32].abs().amax().half().float() / 127
    w = _q8_0(w)
    x = torch.stack([w[10] * 200, w[10] * 180, torch.randn(64, generator=g)])
    emb = cpu.int8_embedding(w)
    assert emb is not None
    exact = (x.double() @ w.double().T).float()
    assert exact[0, 11] > exact[0, 10] and exact[:2].argmax(-1).tolist() == [11, 11]
    got = emb.logits(x)
    ids = got.topk(cpu.HEAD_EXACT_TOP, dim=-1).indices
    torch.testing.assert_close(got.gather(-1, ids), exact.gather(-1, ids), rtol=1e-6, atol=1e-5)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    kernel = cpu.packed_linear(x, emb.head)
    rest = torch.ones_like(got, dtype=torch.bool).scatter_(-1, ids, False)
    assert torch.equal(got[rest], kernel[rest])
    monkeypatch.setattr(cpu, "HEAD_EXACT_TOP", 0)  # the kernel's bf16 logits alone: row 11 loses the tie
    assert not torch.equal(emb.logits(x)[:2].argmax(-1), exact[:2].argmax(-1))
