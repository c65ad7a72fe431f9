"""FP8 kernels (Triton interpreter, E4M3 rounding emulated as kernels/fp8.py says) against the torch definitions
of tinypaged/model/quant/fp8.py: the quantization bit for bit and the dispatch of `fp8_linear` up to
the order of float32 sums.

The fused producers round each value to the activation dtype before quantizing it, as their plain kernels store
it: their reference, bit for bit, is `quantize_per_token` of the plain kernel's output (itself tested against
`ops`' references in test_norm_kernel.py and test_activation_kernel.py). Against the composition written out in
torch they agree to one E4M3 step: the interpreter's sigmoid is not torch's to the last ulp, and a value that
moves by an ulp across a rounding midpoint takes the neighbouring E4M3 code."""

from __future__ import annotations

import pytest
import torch

from tinypaged import kernels as tk
from tinypaged.model.quant import fp8
from tinypaged.quantization import Fp8Scheme

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rows(t: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows over many magnitudes (E4M3 subnormals after scaling too), a -0.0 and, past two rows, a zero
    row (its scale is MIN_SCALE / 448)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen) * torch.logspace(-5, 2, k)[torch.randperm(k, generator=gen)]
    if t:
        x[0, 0] = -0.0
    if t > 2:
        x[2] = 0.0
    return x.to(dtype)


def assert_same_fp8(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The E4M3 bytes and the float32 scales equal."""
    assert got[0].dtype == torch.float8_e4m3fn and got[1].dtype == torch.float32
    assert got[1].shape == want[1].shape == (got[0].shape[0], 1)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 100), (2, 16384 + 40)])
def test_quantize_per_token(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """Bit for bit `quantize_per_token`: a row in one tile, not a power of two, and past one tile (two passes)."""
    x = rows(*shape, dtype, seed=shape[1])
    assert_same_fp8(tk.quantize_fp8(x), fp8.quantize_per_token(x))


def test_quantize_static_scale_and_strided_rows() -> None:
    """A static scale (the checkpoint's input_scale) for every row, saturating at +-448; rows a slice of a wider
    tensor."""
    x = rows(4, 96, torch.bfloat16)[:, 16:80]
    scale = torch.tensor([0.01])
    q, s = tk.quantize_fp8(x, scale)
    assert_same_fp8((q, s), (fp8.quantize(x, scale), scale.expand(4, 1)))
    assert q.float().abs().max() == 448.0


def test_e4m3_rounding_of_every_code_and_midpoint() -> None:
    """Every finite E4M3 value, the midpoints between neighbours (ties to even) and values just off them, at
    scale 1: the interpreter's emulated rounding is torch's cast."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = codes[~codes.isnan()].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), grid * 1.01]).clamp(-448, 448)[None]
    one = torch.ones(1)
    assert_same_fp8(tk.quantize_fp8(x, one), (fp8.quantize(x, one), one.expand(1, 1)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_fp8(dtype: torch.dtype, residual: bool) -> None:
    """The fused norm's rows are the plain kernel's, quantized per token; the residual sum is the plain one's."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=gen).to(dtype)
    res = torch.randn(5, 96, generator=gen).to(dtype) if residual else None
    weight = torch.randn(96, generator=gen).to(dtype)
    q, scale, res_sum = tk.rms_norm_fp8(x, weight, 1e-5, res)
    plain = tk.rms_norm(x, weight, 1e-5, res)
    out = plain[0] if residual else plain
    assert_same_fp8((q, scale), fp8.quantize_per_token(out))
    if residual:
        assert torch.equal(res_sum, plain[1])
    else:
        assert res_sum is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (2, 16384 + 16)])
def test_silu_and_mul_fp8(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """The fused SwiGLU's rows are the plain kernel's, quantized per token, and the torch composition's to one
    E4M3 step: in tiles, and one program a row (in one tile and past one, two passes)."""
    t, i = shape
    x = (3 * torch.randn(t, 2 * i, generator=torch.Generator().manual_seed(i))).to(dtype)
    got = tk.silu_and_mul_fp8(x)
    assert_same_fp8(got, fp8.quantize_per_token(tk.silu_and_mul(x)))
    # The few-row steps' two tiled launches and the one-program-a-row launch of larger steps: the same bits.
    one_tile = i <= 16384
    assert_same_fp8(got, tk.silu_and_mul_fp8(x, (one_tile, 16384 if one_tile else 4096, 16)))
    gate, up = x.float().chunk(2, dim=-1)
    want = fp8.quantize_per_token((gate * torch.sigmoid(gate) * up).to(dtype))
    torch.testing.assert_close(got[1], want[1], rtol=2**-7, atol=0)
    torch.testing.assert_close(
        fp8.dequantize(*got), fp8.dequantize(*want), rtol=2**-3, atol=2**-9 * want[1].max().item()
    )


def weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An E4M3 weight `[n, k]` and its per-row scales."""
    gen = torch.Generator().manual_seed(seed)
    return fp8.quantize_per_channel(torch.randn(n, k, generator=gen) / k**0.5)


def assert_close_to_ref(y: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the order of float32 sums and the scales' multiplication order (plus one ulp of the output
    dtype: the interpreter's bfloat16 cast truncates)."""
    assert y.dtype == want.dtype and y.shape == want.shape
    ulp = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}[y.dtype]
    atol = 1e-5 * want.float().abs().max().item()
    torch.testing.assert_close(y.double(), want.double(), rtol=ulp + 1e-5, atol=atol)


@pytest.mark.parametrize(
    "scheme",
    [
        ("token", None, None),
        ("static", None, torch.tensor([0.02])),
        ("group", (16, 32), None),
        (None, None, None),
    ],
)
@pytest.mark.parametrize("m", [1, 4, 11, fp8.GEMM_ROWS + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_dispatch(
    scheme: tuple, m: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fp8_linear` gives `ref_fp8_linear`'s numbers whichever path the rows take: the Triton FP8 matmul up to
    GEMM_ROWS, torch._scaled_mm (here torch's CPU one, with the
    arguments the GPU's takes: a row-major, b column-major, scales [M, 1] and [1, N]) for more bf16 rows, the
    float32 reference for float32 rows, block scales and weight-only layers."""
    activations, block, input_scale = scheme
    n, k = 48, 64
    w, ws = weight(n, k, seed=m)
    if block is not None:
        w, ws = w, torch.rand(n // block[0], k // block[1]) / 100
    x = rows(m, k, dtype, seed=m + 7)
    bias = torch.randn(n).to(dtype)
    calls = []
    scaled_mm = torch._scaled_mm

    def spy(a: torch.Tensor, b: torch.Tensor, **kw: object) -> torch.Tensor:
        sa, sb = kw["scale_a"], kw["scale_b"]
        assert a.is_contiguous() and b.t().is_contiguous() and b.shape == (k, n)
        assert sa.shape == (a.shape[0], 1) and sb.shape == (1, n) and sa.dtype == sb.dtype == torch.float32  # type: ignore[union-attr]
        calls.append(a.shape[0])
        return scaled_mm(a, b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    weights = "channel" if block is None else "block"
    y = fp8.fp8_linear(x, w, ws, bias, Fp8Scheme(weights, activations, block), input_scale)
    want = fp8.ref_fp8_linear(x, w, ws, bias, activations, input_scale, block)
    fast = activations in ("token", "static") and block is None
    assert calls == ([m] if fast and dtype == torch.bfloat16 and m > fp8.GEMM_ROWS else [])
    assert_close_to_ref(y, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_of_no_rows(dtype: torch.dtype) -> None:
    w, ws = weight(48, 64, seed=0)
    scheme = Fp8Scheme("channel", "token")
    assert fp8.fp8_linear(torch.empty(0, 64, dtype=dtype), w, ws, None, scheme).shape == (0, 48)


def test_the_gluon_fp8_decode_attention_takes_only_batches_that_fill_it() -> None:
    """Decode launches over an FP8 cache go to the Gluon kernel (on by default) from `MIN_PROGRAMS` programs
    (sequences x KV heads) up; fewer, and windows, multi-token queries, float32 queries or a bf16 cache, stay on
    the Triton kernel."""
    mod = tk.attention_fp8
    kv8 = torch.zeros(2, 4, 16, 8, 128, dtype=torch.float8_e4m3fn)
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    if not mod.FP8_DECODE_MMA:
        pytest.skip("switched off (TINYPAGED_FP8_ATTN_MMA=0)")
    at_least = -(-mod.MIN_PROGRAMS // 8)
    assert mod.takes(q, kv8, None, 1, at_least)
    assert not mod.takes(q, kv8, None, 1, at_least - 1)
    assert not mod.takes(q, kv8, 128, 1, at_least)
    assert not mod.takes(q, kv8, None, 4, at_least)
    assert not mod.takes(q.float(), kv8, None, 1, at_least)
    assert not mod.takes(q, kv8.to(torch.bfloat16), None, 1, at_least)
    assert not mod.usable(q, kv8, None, 1, at_least)  # a CPU tensor: never the Gluon kernel
