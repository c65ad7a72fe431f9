"""Weight-only INT4 and INT8 numerics: the kernels' packed layout, round-to-nearest quantization, the dequantized
reference every kernel is tested against, and the dispatch of a layer to its kernel.

The layout is kernels/lowbit.py's (its docstring): codes unsigned, `32 / bits` a word along each weight row
(`qweight` int32 `[N, K * bits / 32]`), float32 `scales` `[K / group, N]`, uint8 `zeros` `[K / group, N]` or
none (symmetric: the zero point is 2^(bits - 1)); a weight is `(code - zero) * scale` in float32. GGUF's
"type-1" blocks (Q4_1, Q5_1, Q4_K, Q5_K: `q * d + m`) add float32 `mins` `[K / group, N]`: a weight is then
`(code - zero) * scale + min`, the zero point 0 unless given (weights/gguf_quant.py; no (zero, scale) pair
gives `q * d + m` exactly in float32). Groups of 16 (Q6_K) and mins run the reference on every device until the
kernels take them. Every
checkpoint format is repacked into it at load (`IntLinearMethod` in model/quant/linear.py, with the
converters below), losslessly: unpacking gives the
checkpoint's own codes, zero points and scales.

`ref_wint_linear` is `x @ dequant(W).T (+ bias)` in float32, returned in x's dtype: what the kernels match, up
to the order of float32 sums (the tensor-core path and the GEMV take the same float32 products; only steps past
GEMM_ROWS round the weight to the activations' dtype first). On the CPU, layers that torch's packed kernels take
(INT4 in groups of 32 to 256, INT8 per row) run them in bf16 (model/quant/cpu.py); the others run the reference
(the weight dequantized a layer at a time: correct, not fast).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tinypaged import ops
from tinypaged.model.quant.cpu import CpuPacked, packed_linear

# Steps of up to GEMV_ROWS rows may go through the Triton GEMV (on the device, `kernels.lowbit.gemv_rows` narrows
# that to the layers and row counts where it measured faster: one row, or none), up to GEMM_ROWS through the
# Triton tensor-core kernel, larger ones dequantize the weight (one launch) and take torch's matmul. GEMM_ROWS
# is the knob between the kernel and dequantize-then-matmul (run 81's graph-timed sweep: the kernel to 64 rows).
GEMV_ROWS = 4
GEMM_ROWS = 64
# Steps in groups of 128 go through kernels/lowbit_mma.py (the weights loaded straight into the tensor cores'
# registers) where `lowbit_mma.usable` says it runs: INT4 from one row up to MMA_ROWS (at 9-16 rows the Triton
# kernel: with `mma_config`'s one-wave tilings there, batch 16 gained 1% on an H100 (run 130) and lost 6% on the
# H200 (run 132), where the Triton kernel's layers take 75.4 us against 82.8, run 133), INT8 from
# INT8_MMA_MIN_ROWS up to INT8_MMA_ROWS (at one row the Triton GEMV is faster; from two rows this kernel, by up
# to 30% at 16 on the H200: runs 119 and 127).
MMA_ROWS = 8
INT8_MMA_MIN_ROWS = 2
INT8_MMA_ROWS = 16


class IntWeight(NamedTuple):
    """A weight as the kernels take it: packed codes, float32 scales, zero points (None: symmetric), the bits
    of a code (4 or 8), the columns of a group, GGUF's float32 per-group offsets (None: none) and, on the CPU,
    the same weight packed for torch's kernels."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group: int
    mins: torch.Tensor | None = None
    cpu: CpuPacked | None = None  # packed for torch's CPU kernels (model/quant/cpu.py), the rest then empty


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes `[N, K]` (any integer dtype, values below 2^bits) as the int32 words `[N, K * bits / 32]`,
    code j of a word in its bits `[j * bits, (j + 1) * bits)`."""
    per = 32 // bits
    n, k = codes.shape
    assert k % per == 0, (k, per)
    c = codes.to(torch.int64).view(n, k // per, per)
    shifts = torch.arange(per, dtype=torch.int64, device=codes.device) * bits
    words = (c << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes `[N, K]` (int32, unsigned values) of packed words `[N, K * bits / 32]`."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=qweight.device) * bits
    codes = (qweight[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2)


# AutoAWQ's GEMM packing puts column order[j] of each run of 8 in bits [4j, 4j + 4) of a word, order being
# (0, 2, 4, 6, 1, 3, 5, 7); column c of a run is then in the word's code _AWQ_CODE[c].
_AWQ_CODE = (0, 4, 1, 5, 2, 6, 3, 7)


def from_gptq(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ's `qweight` `[K * bits / 32, N]` in the kernels' layout: GPTQ packs consecutive input columns into
    a word, the first in the low bits, as the kernels do, only along the other dim: a transpose."""
    return qweight.t().contiguous()


def awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes `[R, N]` of AWQ-packed words `[R, N / 8]` (`qweight`, `qzeros`), in column order."""
    codes = unpack(packed, 4)
    return codes.view(*codes.shape[:-1], -1, 8)[..., list(_AWQ_CODE)].flatten(-2)


def from_awq(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ's `qweight` `[K, N / 8]` in the kernels' layout `[N, K / 8]`."""
    return pack(awq_columns(qweight).t(), 4)


def expand_groups(t: torch.Tensor, group: int) -> torch.Tensor:
    """Per-group values `[K / group, N]` as one per weight `[N, K]`."""
    return t.t().repeat_interleave(group, 1)


def dequantize_weight(w: IntWeight) -> torch.Tensor:
    """The weight `[N, K]` in float32: `(code - zero) * scale (+ min)`, each step rounded to float32 as GGUF's
    own dequantization rounds it (separate ops: never a fused multiply-add)."""
    codes = unpack(w.qweight, w.bits).float()
    n, k = codes.shape
    codes = codes.view(n, k // w.group, w.group)  # per-group values broadcast over their group's columns

    def per_group(t: torch.Tensor) -> torch.Tensor:
        return t.t().float()[..., None]

    if w.zeros is not None:
        codes = codes - per_group(w.zeros)
    elif w.mins is None:
        codes = codes - float(1 << (w.bits - 1))
    weight = codes * per_group(w.scales)
    return (weight if w.mins is None else weight + per_group(w.mins)).view(n, k)


def quantize_rtn(w: torch.Tensor, bits: int, group: int, symmetric: bool) -> IntWeight:
    """A weight `[N, K]` rounded to nearest on `bits`-bit codes per group of `group` columns. Symmetric: scale
    `amax / (2^(bits-1) - 1)`, codes `round(w / scale) + 2^(bits-1)` (the lowest code unused, as in vLLM's and
    llm-compressor's symmetric schemes); asymmetric: scale `(max - min) / (2^bits - 1)` over a range that
    includes 0, zero `round(-min / scale)`. Scales are never below 1e-12."""
    n, k = w.shape
    assert k % group == 0
    g = w.float().reshape(n, k // group, group)
    top = (1 << bits) - 1
    if symmetric:
        half = 1 << (bits - 1)
        scale = (g.abs().amax(-1) / (half - 1)).clamp(min=1e-12)
        codes = (g / scale[..., None]).round().clamp(-half + 1, half - 1) + half
        zeros = None
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / top).clamp(min=1e-12)
        zero = (-lo / scale).round().clamp(0, top)
        codes = ((g / scale[..., None]).round() + zero[..., None]).clamp(0, top)
        zeros = zero.t().to(torch.uint8).contiguous()
    return IntWeight(
        pack(codes.reshape(n, k).to(torch.int32), bits), scale.t().contiguous(), zeros, bits, group
    )


def ref_wint_linear(x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ dequant(W).T (+ bias)` in float32, in x's dtype (x `[..., K]`): the reference."""
    y = x.float() @ dequantize_weight(w).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def wint_linear(x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A weight-only INT4 / INT8 linear layer with `ref_wint_linear`'s numbers, on any device: by the row
    count, the Gluon kernel (INT4 up to MMA_ROWS, INT8 from INT8_MMA_MIN_ROWS to INT8_MMA_ROWS, where it runs),
    the Triton GEMV (up to GEMV_ROWS), the tensor-core kernel (up to GEMM_ROWS) or the weight dequantized to x's
    dtype and torch's matmul; on the CPU torch's packed kernels in bf16 where the layer was packed for them
    (model/quant/cpu.py), else the reference."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if w.cpu is not None:
        return packed_linear(x2, w.cpu, bias).reshape(*lead, -1)
    if not ops.uses_triton(x2) or m == 0 or w.mins is not None or w.group % 32:
        return ref_wint_linear(x, w, bias)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    from tinypaged.kernels import lowbit as kernels
    from tinypaged.kernels import lowbit_mma

    lo, hi = (1, MMA_ROWS) if w.bits == 4 else (INT8_MMA_MIN_ROWS, INT8_MMA_ROWS)
    if lo <= m <= hi and lowbit_mma.usable(x2, w):
        y = lowbit_mma.wint_mma(x2, w, bias)
    elif m <= min(GEMV_ROWS, kernels.gemv_rows(x2, w)):
        y = kernels.wint_gemv(x2, w, bias)
    elif m <= GEMM_ROWS:
        y = kernels.wint_gemm(x2, w, bias)
    else:
        y = torch.nn.functional.linear(x2, kernels.wint_dequantize(w, x2.dtype), bias)
    return y.reshape(*lead, w.qweight.shape[0])
