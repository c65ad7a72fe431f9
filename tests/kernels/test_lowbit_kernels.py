"""The weight-only INT4 / INT8 kernels against the float64 product of the dequantized weight (Triton
interpreter; fp16 and float32 activations, since the interpreter's bf16 arithmetic is wrong: bf16 is checked on
the H200 by benchmarks/lowbit.py).

Tolerances: the GEMV's and the tensor-core kernel's products are float32 (the codes minus their zero point are
exact in fp16, and the group's scale multiplies a float32 dot), so against float64 only float32 sums and the
output's rounding differ: half an fp16 ulp (2^-11 relative) for fp16 out, 1e-5 for float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinypaged.kernels.lowbit import (
    gemm_config,
    gemv_config,
    step_k,
    wint_dequantize,
    wint_gemm,
    wint_gemv,
)
from tinypaged.model.quant import lowbit

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2**-10, 1e-3)}


def operands(m: int, n: int, k: int, bits: int, group: int, symmetric: bool, dtype: torch.dtype, seed: int):
    """Random activations, a random weight rounded to `bits` (with zero points unless symmetric), a bias."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen) / k**0.5 + 0.01
    bias = torch.randn(n, generator=gen).to(dtype)
    return x, lowbit.quantize_rtn(w, bits, group, symmetric), bias


def want(x: torch.Tensor, q: lowbit.IntWeight, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ lowbit.dequantize_weight(q).double().T
    return y if bias is None else y + bias.double()


CASES = [  # (bits, group, symmetric)
    (4, 128, True),
    (4, 128, False),
    (8, 64, True),
    (8, 32, False),
    (4, 96, False),  # a group that is not a power of two: 32-wide steps
]


@pytest.mark.parametrize("bits, group, symmetric", CASES)
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_matches_dequantized_product(m: int, bits: int, group: int, symmetric: bool) -> None:
    """One and three rows, N off the tile, fp16 with bias and float32 without; K split over programs too."""
    k = 3 * group * 2
    x, q, bias = operands(m, 37, k, bits, group, symmetric, torch.float16, seed=m + bits)
    for cfg in (gemv_config(m, 37, k, group), (8, step_k(group), 2, 4)):  # the default, then a K split
        y = wint_gemv(x, q, bias=bias, config=cfg)
        assert y.dtype == torch.float16 and y.shape == (m, 37)
        torch.testing.assert_close(y.double(), want(x, q, bias), rtol=TOL[torch.float16][0], atol=1e-3)
    xf = x.float()
    torch.testing.assert_close(wint_gemv(xf, q).double(), want(xf, q, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits, symmetric", [(4, False), (8, True)])
def test_gemv_steps_over_several_groups(bits: int, symmetric: bool) -> None:
    """A power-of-two group: the GEMV's step may span 2, 4 or 8 whole groups (K split too; 4 rows a one-warp
    program, as bf16's GEMV tiles)."""
    x, q, bias = operands(2, 24, 512, bits, 32, symmetric, torch.float32, seed=bits)
    for cfg in [(8, 64, 1, 4), (16, 128, 2, 4), (4, 256, 1, 1)]:
        y = wint_gemv(x, q, bias=bias, config=cfg)
        torch.testing.assert_close(y.double(), want(x, q, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits, group, symmetric", CASES)
def test_gemm_matches_dequantized_product(bits: int, group: int, symmetric: bool) -> None:
    """Transposed (row tiles under 64) and plain tiles, K split or not, two to four warps, fp16 and float32."""
    m, n, k = 19, 40, 2 * group * 2
    x, q, bias = operands(m, n, k, bits, group, symmetric, torch.float16, seed=bits + group)
    block_k = gemm_config(m, n, k, group)[2]
    for cfg in [
        (32, 32, block_k, 1, 4, 2),
        (16, 64, block_k, 2, 4, 2),
        (64, 16, block_k, 4, 4, 1),
        (16, 64, block_k, 4, 2, 3),
    ]:
        y = wint_gemm(x, q, bias=bias, config=cfg)
        assert y.dtype == torch.float16
        torch.testing.assert_close(y.double(), want(x, q, bias), rtol=TOL[torch.float16][0], atol=1e-3)
    xf = x.float()
    torch.testing.assert_close(wint_gemm(xf, q).double(), want(xf, q, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits, group, symmetric", CASES[:3])
def test_dequantize_kernel_rounds_the_reference_once(bits: int, group: int, symmetric: bool) -> None:
    _, q, _ = operands(1, 40, 2 * group, bits, group, symmetric, torch.float16, seed=3)
    ref = lowbit.dequantize_weight(q)
    assert torch.equal(wint_dequantize(q, torch.float32), ref)
    assert torch.equal(wint_dequantize(q, torch.float16), ref.half())


def test_dispatch_by_rows_matches_the_reference() -> None:
    """`wint_linear` (the op a layer runs) on 1, 8 and 80 rows: GEMV, tensor-core kernel, dequantize + matmul."""
    for m in (1, 8, 80):
        x, q, bias = operands(m, 24, 128, 4, 32, False, torch.float32, seed=m)
        y = lowbit.wint_linear(x, q, bias)
        torch.testing.assert_close(y, lowbit.ref_wint_linear(x, q, bias), rtol=1e-5, atol=1e-5)


def test_configs_at_the_8b_shapes() -> None:
    """The GEMV: 64 rows a program, one group a step, K split 8 ways on narrow outputs and 4 on gate_up (run
    81's sweep); INT8 through the PTX chain at one wave of programs (run 144's sweep); the tensor-core kernel
    splits K up to 8 ways where the tiles leave multiprocessors idle (three programs a multiprocessor, two
    warps, up to 16 rows: run 87's sweep), and down_proj's long K loop 16 ways over 128-row tiles at up to 16
    rows (run 84's sweep)."""
    assert gemv_config(1, 4096, 14336, 128) == (64, 128, 8, 4)  # down_proj
    assert gemv_config(1, 28672, 4096, 128) == (64, 128, 4, 4)  # gate_up
    assert gemv_config(1, 6144, 4096, 128) == (64, 128, 8, 4)
    assert gemv_config(1, 512, 256, 128) == (64, 128, 1, 4)  # two steps: nothing to split
    # INT8 through the PTX chain: one wave of programs holding the most weight rows (run 144's fastest tilings)
    assert gemv_config(1, 6144, 4096, 128, ptx=True) == (64, 128, 8, 4)  # qkv: 768 programs of 924
    assert gemv_config(1, 4096, 4096, 128, ptx=True) == (128, 128, 16, 4)  # o: 512 of 528
    assert gemv_config(1, 4096, 14336, 128, ptx=True) == (128, 128, 16, 4)  # down
    assert gemv_config(1, 28672, 4096, 128, ptx=True) == (64, 128, 2, 4)  # gate_up: 896 of 924
    assert gemv_config(1, 28672, 4096, 128, sms=66, ptx=True) == (64, 128, 1, 4)  # a smaller board: no split
    assert gemm_config(16, 4096, 4096, 128)[:4] == (16, 64, 128, 8)
    assert gemm_config(1, 4096, 14336, 128)[:4] == (16, 128, 128, 16)  # down: a long K loop (run 84)
    assert gemm_config(32, 4096, 14336, 128)[:4] == (32, 64, 128, 8)
    assert gemm_config(1, 6144, 4096, 128) == (16, 64, 128, 8, 2, 3)  # qkv
    assert gemm_config(32, 6144, 4096, 128) == (32, 64, 128, 4, 4, 3)  # from 17 rows: four warps
    assert gemm_config(1, 28672, 4096, 128)[:4] == (16, 128, 128, 2)
    assert gemm_config(64, 28672, 4096, 128)[:4] == (64, 128, 128, 2)


def test_the_gluon_kernel_leaves_gguf_mins_to_the_reference() -> None:
    """`wint_mma` has no term for GGUF's per-group mins (`q * d + m`): `takes` refuses such a weight itself,
    not only through `wint_linear`'s routing."""
    from tinypaged.kernels import lowbit_mma

    x, q, _ = operands(1, 64, 256, 4, 128, False, torch.bfloat16, seed=5)
    assert lowbit_mma.takes(x, q)
    mins = torch.zeros(256 // 128, 64)
    assert not lowbit_mma.takes(x, q._replace(mins=mins))


def test_layers_go_to_the_gluon_kernel_at_its_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """`wint_linear`'s routing where the Gluon kernel runs (a GPU's: `usable` as `takes`): INT4 in groups of 128
    through it at 1-8 rows, INT8 at 2-16 (the Triton GEMV at one row, the tensor-core kernel from 17); with
    `INT8_MMA` off, INT8 never; groups of 64 never."""
    from tinypaged.kernels import lowbit as kernels
    from tinypaged.kernels import lowbit_mma

    calls: list[tuple[str, int]] = []

    def record(name: str):
        return lambda x, w, bias=None: calls.append((name, x.shape[0])) or torch.zeros(x.shape[0], 64)

    monkeypatch.setattr(lowbit_mma, "usable", lowbit_mma.takes)
    monkeypatch.setattr(lowbit_mma, "wint_mma", record("mma"))
    monkeypatch.setattr(kernels, "wint_gemv", record("gemv"))
    monkeypatch.setattr(kernels, "wint_gemm", record("gemm"))
    monkeypatch.setattr(kernels, "gemv_rows", lambda x, w: 0 if w.bits == 4 else 1)  # the device's rule

    def route(bits: int, group: int) -> dict[int, str]:
        calls.clear()
        for m in range(1, 19):
            x, q, _ = operands(m, 64, 256, bits, group, bits == 8, torch.bfloat16, seed=m)
            lowbit.wint_linear(x, q)
        return {m: name for name, m in calls}

    assert route(4, 128) == {m: "mma" if m <= 8 else "gemm" for m in range(1, 19)}
    assert route(8, 128) == {m: "gemv" if m == 1 else "mma" if m <= 16 else "gemm" for m in range(1, 19)}
    assert route(8, 64) == {m: "gemv" if m == 1 else "gemm" for m in range(1, 19)}
    monkeypatch.setattr(lowbit_mma, "INT8_MMA", False)
    assert route(8, 128) == {m: "gemv" if m == 1 else "gemm" for m in range(1, 19)}


def _run_ptx(text: str, regs: dict[str, np.ndarray]) -> None:
    """Run the instructions of an inline-PTX block that INT8's GEMV uses (`prmt.b32` in its default mode,
    `sub.f32`, `mul.rn.f32`, `fma.rn.f32`) on uint32 arrays, in place: the interpreter cannot run PTX. A product
    and a sum are each exact in float64 here, then rounded once to float32."""

    def f32(r: str) -> np.ndarray:
        return regs[r].view(np.float32).astype(np.float64)

    for line in text.splitlines():
        op, _, rest = line.strip().rstrip(";").partition(" ")
        if not rest or op.startswith(".") or op in ("{", "}"):
            continue
        d, *a = [t.strip() for t in rest.split(",")]
        if op == "prmt.b32":
            both = regs[a[0]].astype(np.uint64) | (regs[a[1]].astype(np.uint64) << 32)
            sel = int(a[2], 16)
            out = np.zeros_like(regs[a[0]])
            for i in range(4):
                out |= ((both >> np.uint64(8 * ((sel >> 4 * i) & 7))) & np.uint64(0xFF)).astype(
                    np.uint32
                ) << (8 * i)
            regs[d] = out
        else:
            v = [f32(r) for r in a]
            if op == "sub.f32":
                value = v[0] - v[1]
            elif op == "mul.rn.f32":
                value = v[0] * v[1]
            else:
                assert op == "fma.rn.f32", op
                value = v[0] * v[1] + v[2]
            regs[d] = value.astype(np.float32).view(np.uint32)


@pytest.mark.parametrize("zero", [128, 0, 255, 77])
def test_int8_gemv_ptx_chain(zero: int) -> None:
    """The device's PTX chain for an INT8 word (kernels/lowbit.py `INT8_GEMV_ASM`), emulated: each word's partial
    is sum over its four codes (code j in bits 8j..8j+7) of x_j * (code_j - zero)."""
    from tinypaged.kernels.lowbit import INT8_GEMV_ASM

    rng = np.random.default_rng(zero)
    words = rng.integers(0, 2**32, 512, dtype=np.uint64).astype(np.uint32)
    xs = rng.standard_normal((4, 512)).astype(np.float32)
    regs = {"$1": words, "$6": np.full(512, 2.0**23 + zero, np.float32).view(np.uint32)}
    regs |= {f"${2 + j}": xs[j].view(np.uint32) for j in range(4)}
    _run_ptx(INT8_GEMV_ASM.value, regs)
    codes = (words[None, :] >> (8 * np.arange(4, dtype=np.uint32))[:, None]) & 0xFF
    want = (xs.astype(np.float64) * (codes.astype(np.float64) - zero)).sum(0)
    got = regs["$0"].view(np.float32)
    assert np.allclose(got, want, rtol=1e-6, atol=1e-4)
