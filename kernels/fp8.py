"""FP8 (E4M3) activations: per-token quantization of `[T, K]` rows, plain or of the SwiGLU, and the rounding the
fused RMSNorm shares.

A value is quantized as `tinypaged/model/quant/fp8.py` defines it, bit for bit: `q = E4M3(clamp(x / scale, -448,
448))`, round to nearest even, with a row's dynamic scale `max(amax(|row|), 1e-12) / 448`, both in float32 and
with IEEE division (`tl.div_rn`: Triton's `/` on the GPU is an approximate division, off by an ulp at times).
The plain launch quantizes the rows whose producer does not see a whole row (the attention output, into
o_proj). The SwiGLU's (`silu_and_mul_fp8`, into down_proj) computes its row as `silu_and_mul` does and rounds it
to the activation dtype as that stores it, then quantizes it: one program a row, since the scale needs the whole
row's amax (the plain SwiGLU kernel tiles a row over programs). Rows up to ONE_TILE_MAX columns stay in registers;
longer ones are read twice (the amax, then the values). The RMSNorm kernel (norm.py) quantizes its own rows with
the same helpers.

Triton's interpreter casts float32 to E4M3 wrongly (7.93 becomes 4.0), but converts a value already on the E4M3
grid exactly: under TRITON_INTERPRET the value is first rounded to the grid in float32 (`INTERPRET`, a
constexpr: the GPU takes its native conversion, `cvt.rn.satfinite.e4m3x2.f32`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .activation import swiglu
from .pdl import pdl_options, pdl_start

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ONE_TILE_MAX = 16384  # rows up to this long are quantized from registers in one pass; longer ones in two
TILED_ROWS = 256  # SwiGLU steps of up to this many rows quantize in tiles, two launches (silu_and_mul_fp8)
TILE = 1024


@triton.jit
def to_e4m3(x, INTERPRET: tl.constexpr):
    """float32 x, already within +-448, rounded to E4M3 (nearest even)."""
    if INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        sign = bits & 0x80000000
        mbits = bits & 0x7FFFFFFF
        mag = mbits.to(tl.float32, bitcast=True)
        # Normals keep 3 of float32's 23 mantissa bits: round the low 20 away, ties to even.
        normal = ((mbits + 0x7FFFF + ((mbits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        # Below 2^-6 E4M3 is subnormal, multiples of 2^-9: float32's own rounding at 2^14 gives them.
        sub = (mag + 16384.0) - 16384.0
        r = tl.where(mag < 0.015625, sub, normal).to(tl.uint32, bitcast=True)
        x = (r | sign).to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)


@triton.jit
def dynamic_scale(amax):
    """The scale that maps a row's largest magnitude to 448, the largest E4M3 value (float32, never below
    `fp8.MIN_SCALE`, 1e-12: an all-zero row quantizes to zeros)."""
    return tl.div_rn(tl.maximum(amax, 1e-12), 448.0)


@triton.jit
def quantize_e4m3(x, scale, INTERPRET: tl.constexpr):
    """float32 x over its scale, saturated to +-448, as E4M3."""
    return to_e4m3(tl.clamp(tl.div_rn(x, scale), -448.0, 448.0), INTERPRET)


@triton.jit
def _row_tile(x_row, n_cols, cols, SWIGLU: tl.constexpr):
    """Columns `cols` of a row, in float32: x's own, or (SWIGLU) silu(gate) * up of a gate/up row, rounded to
    x's dtype as `silu_and_mul` stores it."""
    ok = cols < n_cols
    if SWIGLU:
        h = swiglu(x_row, n_cols, cols, ok).to(x_row.dtype.element_ty).to(tl.float32)
    else:
        h = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    return h


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    static_ptr,
    n_cols,
    stride_x,
    stride_q,
    SWIGLU: tl.constexpr,
    STATIC: tl.constexpr,
    ONE_TILE: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Row `program_id` of x (SWIGLU: of silu(gate) * up) as E4M3 with its scale: the row's dynamic one, or the
    static one at static_ptr."""
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    cols = tl.arange(0, BLOCK)
    if ONE_TILE:  # the whole row in registers: read once
        h = _row_tile(x_row, n_cols, cols, SWIGLU)
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            scale = dynamic_scale(tl.max(tl.abs(h), 0))
        tl.store(q_row + cols, quantize_e4m3(h, scale, INTERPRET), mask=cols < n_cols)
    else:  # one pass for the amax, one to quantize
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for c0 in range(0, n_cols, BLOCK):
                amax = tl.maximum(amax, tl.abs(_row_tile(x_row, n_cols, c0 + cols, SWIGLU)))
            scale = dynamic_scale(tl.max(amax, 0))
        for c0 in range(0, n_cols, BLOCK):
            h = _row_tile(x_row, n_cols, c0 + cols, SWIGLU)
            tl.store(q_row + c0 + cols, quantize_e4m3(h, scale, INTERPRET), mask=c0 + cols < n_cols)
    tl.store(scale_ptr + row, scale)


def _launch(
    x: torch.Tensor,
    n_cols: int,
    swiglu: bool,
    static_scale: torch.Tensor | None,
    config: tuple[bool, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 `[T, n_cols]`, float32 scales `[T, 1]`) of x's T rows (rows contiguous). `config`: (one tile, BLOCK,
    num_warps), default from the row length (benchmarks/fp8_kernels.py times others)."""
    assert x.dim() == 2 and x.stride(1) == 1
    n_rows = x.shape[0]
    q = torch.empty((n_rows, n_cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((n_rows, 1), dtype=torch.float32, device=x.device)
    if n_rows:
        # Rows up to ONE_TILE_MAX in one tile (at most 32 values a thread), longer ones in tiles walked twice.
        one_tile = n_cols <= ONE_TILE_MAX
        block = triton.next_power_of_2(max(n_cols, 1)) if one_tile else 4096
        warps = min(16, max(1, block // 512))
        if config is not None:
            one_tile, block, warps = config
        _quantize_kernel[(n_rows,)](
            x,
            q,
            scale,
            static_scale if static_scale is not None else scale,
            n_cols,
            x.stride(0),
            q.stride(0),
            SWIGLU=swiglu,
            STATIC=static_scale is not None,
            ONE_TILE=one_tile,
            BLOCK=block,
            INTERPRET=INTERPRET,
            num_warps=warps,
            **pdl_options(x),
        )
    return q, scale


def quantize_per_token(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[T, K]` (rows contiguous) as E4M3, one float32 scale a row: (q `[T, K]`, scale `[T, 1]`). The scale
    is the row's dynamic one, or `static_scale` (one element) for every row (semantics:
    `fp8.quantize_per_token`, `fp8.quantize`)."""
    return _launch(x, x.shape[1], False, static_scale)


@triton.jit
def _swiglu_tiles_kernel(
    x_ptr,
    h_ptr,
    amax_ptr,
    n_cols,
    stride_x,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Tile program_id(1) of row program_id(0)'s SwiGLU, rounded to x's dtype (into h), and its amax."""
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    h = _row_tile(x_ptr + row * stride_x, n_cols, cols, True)
    tl.store(h_ptr + row * n_cols + cols, h.to(h_ptr.dtype.element_ty), mask=cols < n_cols)
    tl.store(amax_ptr + row * tl.num_programs(1) + tile, tl.max(tl.abs(h), 0))


@triton.jit
def _quantize_tiles_kernel(
    h_ptr,
    amax_ptr,
    q_ptr,
    scale_ptr,
    n_cols,
    TILES: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Tile program_id(1) of row program_id(0) of h as E4M3, with the row's scale from its tiles' amaxes."""
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    n_tiles = tl.num_programs(1)
    t = tl.arange(0, TILES)
    scale = dynamic_scale(tl.max(tl.load(amax_ptr + row * n_tiles + t, mask=t < n_tiles, other=0.0), 0))
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    h = tl.load(h_ptr + row * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(q_ptr + row * n_cols + cols, quantize_e4m3(h, scale, INTERPRET), mask=ok)
    if tile == 0:
        tl.store(scale_ptr + row, scale)


def silu_and_mul_fp8(
    x: torch.Tensor, config: tuple[bool, int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up of x `[T, 2 * I]` (gate then up; rows as `silu_and_mul` takes them) quantized per token:
    (E4M3 `[T, I]`, float32 scale `[T, 1]`), exactly `fp8.quantize_per_token(silu_and_mul(x))`.

    The scale needs the whole row's amax. Up to TILED_ROWS rows, two launches of many programs a row: the
    SwiGLU's tiles with their amaxes, then the tiles quantized with the row's scale (a row of one program took
    5.9 us at one row where the plain SwiGLU takes 1.1, H200, NOTES.md). More rows: one program a row
    (`config` forces that path: (one tile, BLOCK, num_warps))."""
    assert x.shape[1] % 2 == 0
    n_rows, n_cols = x.shape[0], x.shape[1] // 2
    if config is not None or n_rows > TILED_ROWS or n_rows == 0:
        return _launch(x, n_cols, True, None, config)
    assert x.stride(1) == 1
    tiles = triton.cdiv(n_cols, TILE)
    h = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    amax = torch.empty((n_rows, tiles), dtype=torch.float32, device=x.device)
    q = torch.empty((n_rows, n_cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((n_rows, 1), dtype=torch.float32, device=x.device)
    grid = (n_rows, tiles)
    _swiglu_tiles_kernel[grid](x, h, amax, n_cols, x.stride(0), BLOCK=TILE, num_warps=4, **pdl_options(x))
    _quantize_tiles_kernel[grid](
        h,
        amax,
        q,
        scale,
        n_cols,
        TILES=triton.next_power_of_2(tiles),
        BLOCK=TILE,
        INTERPRET=INTERPRET,
        num_warps=4,
        **pdl_options(x),
    )
    return q, scale
