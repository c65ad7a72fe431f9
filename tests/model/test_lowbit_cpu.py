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
