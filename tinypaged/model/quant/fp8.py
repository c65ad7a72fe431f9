"""FP8 (E4M3) numerics: the definition of every FP8 op, in torch, on any device, and the dispatch of each to its
GPU kernels.

The GPU kernels (fused activation quantization, FP8 GEMV, FP8 matmul) and `torch._scaled_mm` are tested against these
functions and give the same numbers (up to the order of float32 sums); on the CPU the references are the FP8 path
itself (emulation: FP8 values held in torch's float8_e4m3fn, the matmul done in float32 on the dequantized values).

- Scales are float32, and a value is quantized as `clamp(x / scale, -448, 448)` cast to E4M3 (round to nearest
  even): division, not multiplication by a reciprocal, so that a kernel reproduces it bit for bit.
- A weight is dequantized as `q * scale` (per tensor, per output row, or per block of rows x columns); an
  activation row likewise, its scale `amax(|row|) / 448` (dynamic) or the checkpoint's (static).
- `ref_fp8_linear` is then `dequant(x) @ dequant(w).T (+ bias)` in float32, cast to x's dtype.

The ops a model step runs (`per_token`, `rms_norm`, `silu_and_mul`, `fp8_linear`) pick the kernels as
`tinypaged.ops` does (Triton for CUDA tensors and under TRITON_INTERPRET, the references otherwise and under
TINYPAGED_TORCH_OPS); none of them waits for the GPU, so CUDA graphs capture them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tinypaged import ops
from tinypaged.model.quant.e4m3 import FP8_DTYPE as FP8_DTYPE  # linear.py reads it here
from tinypaged.model.quant.e4m3 import FP8_MAX, dequantize, quantize
from tinypaged.quantization import Fp8Scheme

# The smallest scale a dynamic quantization takes, so that an all-zero row or tensor quantizes to zeros.
MIN_SCALE = 1e-12
# Steps of up to GEMM_ROWS rows go through the Triton FP8 matmul (kernels/fp8_gemm.py), larger ones through
# torch._scaled_mm (cuBLASLt): where each is fastest on the H200's 8B layers (benchmarks/NOTES.md, "The FP8 matmul
# split along K": faster than an FP8 GEMV at every row count, one included; in W1's decode steps of 130-256 rows
# cuBLASLt took 3.8 ms a step where the Triton matmul took 5.1, run 64).
GEMM_ROWS = 128


class Fp8Activation(NamedTuple):
    """A layer's input rows `[T, K]` quantized per token, as the kernel that produced them emits them for an
    FP8 layer: E4M3 values, one float32 scale a row (`[T, 1]`), and the dtype the rows had unquantized (the
    layer's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        """The rows' shape, as a tensor's (so that code reading `x.shape` takes either)."""
        return self.q.shape


def dynamic_scale(x: torch.Tensor, dim: int | None = -1) -> torch.Tensor:
    """The scale that maps the largest magnitude along `dim` (None: of the whole tensor) to 448, float32."""
    amax = x.float().abs().amax() if dim is None else x.float().abs().amax(dim, keepdim=True)
    # Over a tensor on amax's device: torch's CUDA division by a Python number multiplies by its reciprocal,
    # an ulp off at times, where the kernels and the CPU divide.
    return amax.clamp(min=MIN_SCALE) / amax.new_full((), FP8_MAX)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight `[out, in]` as E4M3 with one scale per output row: (q `[out, in]`, scale `[out]` float32)."""
    scale = dynamic_scale(w)
    return quantize(w, scale), scale[:, 0]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `[T, K]` as E4M3 with one dynamic scale per row: (q, scale `[T, 1]`)."""
    scale = dynamic_scale(x)
    return quantize(x, scale), scale


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `[T, K]` as E4M3 with one dynamic scale per row and group of `group` columns (the last
    group may be shorter): (q `[T, K]`, scale `[T, ceil(K / group)]`)."""
    t, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % group)).view(t, -1, group)
    scale = dynamic_scale(padded)
    return quantize(padded, scale).view(t, -1)[:, :k], scale[..., 0]


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
) -> torch.Tensor:
    """An E4M3 weight `[out, in]` in float32: `q * scale`, scale `[out]` per row (a per-tensor scale is
    expanded to every row) or `[ceil(out / rows), ceil(in / cols)]` per block."""
    if block is None:
        return dequantize(q, scale.float()[:, None])
    rows, cols = q.shape
    full = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return dequantize(q, full)


def dequantize_activations(
    x: torch.Tensor, activations: str | None, input_scale: torch.Tensor | None = None, group: int = 0
) -> torch.Tensor:
    """The layer's input `[T, K]` as the FP8 matmul sees it, in float32: quantized and dequantized per token
    ("token"), per token and group of `group` columns ("group"), with the static `input_scale` ("static"), or
    as it is (None)."""
    if activations is None:
        return x.float()
    if activations == "token":
        q, scale = quantize_per_token(x)
        return dequantize(q, scale)
    if activations == "static":
        assert input_scale is not None
        return dequantize(quantize(x, input_scale), input_scale)
    if activations == "group":
        t, k = x.shape
        q, scale = quantize_per_token_group(x, group)
        return dequantize(q, scale.repeat_interleave(group, 1)[:, :k])
    raise ValueError(f"unknown FP8 activation quantization {activations!r}")


def ref_fp8_linear(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    activations: str | None = "token",
    input_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`x @ W.T + bias` with W in E4M3 (see `dequantize_weight`) and x quantized as `activations` says (see
    `dequantize_activations`; "group" takes the block's column count), or already quantized per token (an
    `Fp8Activation`): the exact dequantized reference, in float32, returned in x's dtype. x is `[T, K]` (or any
    leading shape)."""
    if isinstance(x, Fp8Activation):
        lead, dtype, xd = x.q.shape[:-1], x.dtype, dequantize(x.q, x.scale)
    else:
        lead, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        xd = dequantize_activations(x2, activations, input_scale, block[1] if block else 0)
    y = xd @ dequantize_weight(weight, weight_scale, block).T
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype).reshape(*lead, weight.shape[0])


# ---------------------------------------------------------------------------------------------------------
# The ops a model step runs: each its kernel, or its reference (the definition above).
# ---------------------------------------------------------------------------------------------------------


def per_token(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> Fp8Activation:
    """Rows x `[T, K]` quantized per token (`quantize_per_token`), or all with the static `input_scale`: on the
    GPU one fused launch, for inputs whose producer does not see whole rows (the attention output)."""
    if ops.uses_triton(x):
        from tinypaged.kernels import quantize_fp8

        return Fp8Activation(*quantize_fp8(x, input_scale), x.dtype)
    if input_scale is None:
        return Fp8Activation(*quantize_per_token(x), x.dtype)
    return Fp8Activation(quantize(x, input_scale), input_scale.float().expand(x.shape[0], 1), x.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> Fp8Activation | tuple[Fp8Activation, torch.Tensor]:
    """`ops.rms_norm` (x `[T, C]`) with its output quantized per token: exactly `per_token(ops.rms_norm(...))`,
    the quantization fused into the norm's kernel on the GPU. With `residual`, also returns the sum."""
    if ops.uses_triton(x):
        from tinypaged.kernels import rms_norm_fp8

        q, scale, res = rms_norm_fp8(x, weight, eps, residual)
        out = Fp8Activation(q, scale, x.dtype)
        return out if res is None else (out, res)
    out = ops.ref_rms_norm(x, weight, eps, residual)
    if isinstance(out, torch.Tensor):
        return per_token(out)
    return per_token(out[0]), out[1]


def silu_and_mul(x: torch.Tensor) -> Fp8Activation:
    """`ops.silu_and_mul` (x `[T, 2 * I]`) with its output quantized per token: exactly
    `per_token(ops.silu_and_mul(x))`, the quantization fused into the SwiGLU's kernel on the GPU."""
    if ops.uses_triton(x):
        from tinypaged.kernels import silu_and_mul_fp8

        return Fp8Activation(*silu_and_mul_fp8(x), x.dtype)
    return per_token(ops.ref_silu_and_mul(x))


def fp8_linear(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    scheme: Fp8Scheme,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A linear layer of `scheme` (its parameters as `Fp8LinearMethod` holds them) with `ref_fp8_linear`'s
    numbers: the FP8 linear op every device runs.

    Per-row weight scales with activations per token (quantized here by `per_token` unless x comes quantized)
    or static run W8A8 on the GPU: up to GEMM_ROWS rows through the Triton FP8 matmul, more through
    `torch._scaled_mm` (cuBLASLt's FP8 matmul, rowwise scales, bf16 or fp16 out; float32 outputs and sizes not
    multiples of 16 take the float32 reference on the quantized rows).
    Block scales and weight-only layers run the float32 reference (dequantized weights, one matmul: correct,
    not fast), as does the CPU.
    """
    activations, block = scheme.activations, scheme.block
    rows = x.q if isinstance(x, Fp8Activation) else x
    if block is not None or activations not in ("token", "static") or not ops.uses_triton(rows):
        return ref_fp8_linear(x, weight, weight_scale, bias, activations, input_scale, block)
    if isinstance(x, Fp8Activation):
        return _w8a8(x, weight, weight_scale, bias)
    x2 = x.reshape(-1, x.shape[-1])
    xa = per_token(x2, input_scale if activations == "static" else None)
    return _w8a8(xa, weight, weight_scale, bias).reshape(*x.shape[:-1], weight.shape[0])


def _w8a8(
    x: Fp8Activation, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Quantized rows times an E4M3 weight with per-row scales, by the row count (see `fp8_linear`)."""
    m = x.q.shape[0]
    n, k = weight.shape
    if m <= GEMM_ROWS:
        from tinypaged.kernels.fp8_gemm import fp8_gemm

        return fp8_gemm(x.q, x.scale, weight, w_scale, bias, x.dtype)
    if x.dtype in (torch.bfloat16, torch.float16) and n % 16 == 0 and k % 16 == 0:
        # a row-major, b column-major (W [N, K] transposed, no copy), scales [M, 1] and [1, N], float32.
        return torch._scaled_mm(
            x.q, weight.t(), scale_a=x.scale, scale_b=w_scale.view(1, n), bias=bias, out_dtype=x.dtype
        )
    return ref_fp8_linear(x, weight, w_scale, bias)
