"""Weight-only INT4 and INT8 linear layers: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias), x in bf16 or fp16
(float32 too, for the CPU's interpreter), W as integer codes with float32 scales per output row and group of
`group` input columns (a multiple of 32 that divides K; 128 by default).

The layout (`model/quant/lowbit.py` packs it, and repacks every checkpoint format into it):
- `qweight` int32 `[N, K * bits / 32]`: along each weight row, 32 / bits unsigned codes per int32, code j of
  a word in bits `[j * bits, (j + 1) * bits)` (8 INT4 or 4 INT8 codes a word, the first in the low bits). This
  is compressed-tensors' pack-quantized layout; a program reads whole rows of words, 16 bytes a load.
- `scales` float32 `[K / group, N]`: group g of row n at `[g, n]`, so that one step's scales for a program's
  rows are one contiguous load.
- `zeros` uint8 `[K / group, N]` (asymmetric weights), or none: the zero point is then 2^(bits - 1) (symmetric).
- A weight is `(code - zero) * scale`, computed in float32 (exact: the difference is a small integer).

Three paths, by the step's row count (`model/quant/lowbit.py` dispatches):
- `wint_gemv` (1-4 rows): a program owns BLOCK_N weight rows and walks K one group (or a power-of-two part of
  one; or, with a power-of-two group, several whole groups: a config the sweep tries) at a time. It keeps the
  loaded words as they are and takes code j of every word in turn against the activations at columns
  `word * 32 / bits + j` (no reshape: splitting the packed dimension would cost a trip through shared memory),
  turns codes into floats by setting them into 2^23's mantissa (no integer-to-float instruction, which runs
  at a quarter of the float rate), and keeps a float32 partial a word per thread, scaled once a step, as
  kernels/gemv.py does for bf16. INT8 at one row of bf16 or fp16 on the device takes each word's four products
  in one inline-PTX chain (`INT8_GEMV_ASM`: a `prmt`, a subtraction and a multiply-add a weight, the same
  values and roundings as the float32 route, where the compiler spends five or six instructions a weight), its
  activations read 8 bytes a word, at `gemv_config`'s one-wave tilings. Where the output is narrow (4,096
  columns make 128 programs of 32 rows, fewer than an H200's 132 multiprocessors) K is split over SPLIT programs
  that write float32 partial sums and count themselves in on the tile's counter; the last to arrive adds the
  partials in split order (never arrival order: deterministic), adds the bias and stores the tile, and sets the
  counter back to zero, as kernels/fp8_gemm.py does (one launch a layer: run 81 found the small layers
  latency-bound).
  Products and sums are float32: it matches the float32 reference up to the order and rounding of the sums.
- `wint_gemm` (from one row for INT4 with bf16 or fp16 activations, else from two; up to 64 rows:
  `gemv_rows` and model/quant/lowbit.py dispatch): tiles through the tensor cores. INT4 codes in bf16 or fp16
  become half-precision pairs in inline PTX (`_int4_halves`: two weights a `prmt`/`lop3`/`fma` chain), the
  activations of a step come in one load and are dealt into the eight code positions' columns. The codes
  minus the zero point are small integers, exact in bf16 and fp16, so each step's `tl.dot` of the activations
  against them (float32 accumulation) is exact up to float32 sums, and the group's scale multiplies the step's
  float32 result: the only rounding beyond the reference's is the order of float32 sums. Up to 32 rows the
  tile is computed transposed (weight rows on the tensor cores' 64-row side), as kernels/fp8_gemm.py does; K
  splits as above.
- Larger steps: `wint_dequantize` writes the weight in the activations' dtype (one rounding a weight) for
  torch's matmul; the crossover is `GEMM_ROWS` in model/quant/lowbit.py (run 81: the kernel wins to 64 rows).

Every launch allocates with torch.empty only and never reads a value back, so CUDA graphs capture it.

One job, past 450 lines: the weight-only layer's kernels over one packed layout. The GEMV, the tensor-core
kernel and the dequantize kernel share the layout's loads (`_codes`, `_group_params`, `_minus_zero`), one kernel
body holds both matmul paths (they differ in a step's arithmetic only), and the launchers share `_check`,
`_launch` and the configs; split apart, each would repeat the layout's decoding.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import triton
import triton.language as tl

from .attention_configs import num_sms
from .fp8 import INTERPRET
from .fp8_gemm import MAX_TILES, split_sum, tile_counters
from .pdl import pdl_options, pdl_start


class IntWeight(Protocol):
    """What the launchers read of a weight: model/quant/lowbit.py's `IntWeight` (packed codes, float32 scales,
    uint8 zero points or None, bits of a code, columns of a group)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group: int


GEMV_MAX_ROWS = 4
INT8_GEMV_PTX = os.environ.get("TINYPAGED_INT8_GEMV_PTX", "1") == "1"  # `gemv_ptx`
# Registers a thread of INT8's GEMV through the PTX chain at one row, four warps, by weight rows a program
# (sm_90, Triton 3.6; tests/test_kernel_compiles.py holds the compiler to them): `gemv_config` sizes a wave by them.
GEMV_PTX_REGS = {32: 48, 64: 72, 128: 128}


@triton.jit
def _codes(
    w_ptr, cols, kp0, stride_w, col_ok, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """The int32 codes `[BLOCK_N, BLOCK_K]` of weight rows `cols` from packed word kp0 on."""
    PACK: tl.constexpr = 32 // BITS
    kp = kp0 + tl.arange(0, BLOCK_K // PACK)
    words = tl.load(
        w_ptr + cols.to(tl.int64)[:, None] * stride_w + kp[None, :], mask=col_ok[:, None], other=0
    )
    shifts = tl.arange(0, PACK) * BITS
    codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, (BLOCK_N, BLOCK_K))


@triton.jit
def _group_params(s_ptr, z_ptr, g, cols, col_ok, stride_s, BITS: tl.constexpr, HAS_ZERO: tl.constexpr):
    """Group g's (scale, zero point) of weight rows `cols`, float32 `[BLOCK_N]` each."""
    s = tl.load(s_ptr + g * stride_s + cols, mask=col_ok, other=0.0)
    if HAS_ZERO:
        z = tl.load(z_ptr + g * stride_s + cols, mask=col_ok, other=0).to(tl.float32)
    else:
        z = tl.zeros_like(s) + (1 << (BITS - 1))
    return s, z


@triton.jit
def _minus_zero(words, j: tl.constexpr, zero, BITS: tl.constexpr):
    """Code j of each packed word minus its row's zero point, float32 (exact: a small integer). The code goes
    into the low mantissa bits of 2^23 (0x4B000000) and the float's bits are read as they are, so no
    integer-to-float conversion runs (a quarter-rate instruction): 2^23 + code - (2^23 + zero)."""
    bits = ((words >> (j * BITS)) & ((1 << BITS) - 1)) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - (zero + 8388608.0)


# Eight INT4 codes a word into half-precision pairs (Marlin's trick, written here for Triton): `prmt` puts the
# low (then high) 16 bits of two neighbouring words side by side; each nibble j then lands in the low mantissa
# bits of a magic half (bf16 128, fp16 1024: one unit a step there) with one `lop3` (and a shift), and one
# packed fused multiply-add takes away the magic and the zero point: code - zero, exact. Two weights an
# instruction where the float32 route (`_minus_zero`) spends four a weight.
_INT4_ASM = """
{
.reg .b32 t0, t1, s, one;
mov.b32 one, ONE;
prmt.b32 t0, $8, $9, 0x5410;
prmt.b32 t1, $8, $9, 0x7632;
lop3.b32 s, t0, 0x000F000F, MAGIC, 0xEA;
fma.rn.TY $0, s, one, $10;
shr.u32 s, t0, 4;
lop3.b32 s, s, 0x000F000F, MAGIC, 0xEA;
fma.rn.TY $1, s, one, $10;
shr.u32 s, t0, 8;
lop3.b32 s, s, 0x000F000F, MAGIC, 0xEA;
fma.rn.TY $2, s, one, $10;
shr.u32 s, t0, 12;
lop3.b32 s, s, 0x000F000F, MAGIC, 0xEA;
fma.rn.TY $3, s, one, $10;
lop3.b32 s, t1, 0x000F000F, MAGIC, 0xEA;
fma.rn.TY $4, s, one, $10;
shr.u32 s, t1, 4;
lop3.b32 s, s, 0x000F000F, MAGIC, 0xEA;
fma.rn.TY $5, s, one, $10;
shr.u32 s, t1, 8;
lop3.b32 s, s, 0x000F000F, MAGIC, 0xEA;
fma.rn.TY $6, s, one, $10;
shr.u32 s, t1, 12;
lop3.b32 s, s, 0x000F000F, MAGIC, 0xEA;
fma.rn.TY $7, s, one, $10;
}
"""
INT4_BF16_ASM = tl.constexpr(
    _INT4_ASM.replace("ONE", "0x3F803F80").replace("MAGIC", "0x43004300").replace("TY", "bf16x2")
)
INT4_FP16_ASM = tl.constexpr(
    _INT4_ASM.replace("ONE", "0x3C003C00").replace("MAGIC", "0x64006400").replace("TY", "f16x2")
)


@triton.jit
def _int4_halves(words, zero, DT: tl.constexpr, ASM: tl.constexpr):
    """The eight codes of each word `[BLOCK_N, W]` minus their row's zero point (float32 `[BLOCK_N, 1]`), as
    eight `[BLOCK_N, W]` tensors in DT (bf16 or fp16; exact: small integers); tensor j holds code j, the weight
    at column `word * 8 + j`. ASM: the inline PTX above (the device); else the same values through
    `_minus_zero` (Triton's interpreter, which cannot run PTX)."""
    if ASM:
        if DT == tl.bfloat16:
            asm: tl.constexpr = INT4_BF16_ASM
            magic: tl.constexpr = 128.0
        else:
            asm: tl.constexpr = INT4_FP16_ASM
            magic: tl.constexpr = 1024.0
        neg = (tl.zeros(words.shape, tl.float32) - (zero + magic)).to(DT)
        out = tl.inline_asm_elementwise(
            asm, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [words, neg], (neg.dtype,) * 8, is_pure=True, pack=2
        )
    else:
        out = (
            _minus_zero(words, 0, zero, 4).to(DT),
            _minus_zero(words, 1, zero, 4).to(DT),
            _minus_zero(words, 2, zero, 4).to(DT),
            _minus_zero(words, 3, zero, 4).to(DT),
            _minus_zero(words, 4, zero, 4).to(DT),
            _minus_zero(words, 5, zero, 4).to(DT),
            _minus_zero(words, 6, zero, 4).to(DT),
            _minus_zero(words, 7, zero, 4).to(DT),
        )
    return out


@triton.jit
def _columns_by_code(x_rows, k0, row_ok, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The activations of one K step `[BLOCK_M, BLOCK_K]`, one contiguous load, dealt into eight `[BLOCK_M,
    BLOCK_K / 8]` tensors: tensor j holds columns `8 * word + j`, the columns INT4 code j of each word meets.
    (Eight strided loads instead put a global load's latency before each of the step's eight dots.)"""
    x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=row_ok[:, None], other=0.0)
    x = tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 2, 2, 2))  # column 8 * word + 4 * a + 2 * b + c
    e, o = tl.split(x)  # c = 0, 1
    e0, e1 = tl.split(e)  # b
    o0, o1 = tl.split(o)
    x0, x4 = tl.split(e0)  # a
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _gemv_words(
    w_ptr, s_ptr, z_ptr, k0, cols, col_ok, stride_w, stride_s,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """A GEMV step's packed words `[BLOCK_N, BLOCK_K / PACK]` from column k0 and their scales and zero points,
    float32 `[BLOCK_N, 1]` (a step in one group) or `[BLOCK_N, BLOCK_K / PACK]` (several whole groups a step: a
    scale per word)."""
    PACK: tl.constexpr = 32 // BITS
    # k0 is a multiple of BLOCK_K: the words' row runs start 16-byte aligned (stride_w is, at 16 divisibility).
    kp = tl.multiple_of(k0 // PACK, BLOCK_K // PACK) + tl.arange(0, BLOCK_K // PACK)
    words = tl.load(
        w_ptr + cols.to(tl.int64)[:, None] * stride_w + kp[None, :], mask=col_ok[:, None], other=0
    )
    if BLOCK_K > GROUP:  # several whole groups a step (a power-of-two group): a scale per word
        g = (kp * PACK) // GROUP
        s = tl.load(s_ptr + g[None, :] * stride_s + cols[:, None], mask=col_ok[:, None], other=0.0)
        if HAS_ZERO:
            z = tl.load(z_ptr + g[None, :] * stride_s + cols[:, None], mask=col_ok[:, None], other=0)
            z = z.to(tl.float32)
        else:
            z = tl.zeros_like(s) + (1 << (BITS - 1))
    else:
        s, z = _group_params(s_ptr, z_ptr, k0 // GROUP, cols, col_ok, stride_s, BITS, HAS_ZERO)
        s = s[:, None]
        z = z[:, None]
    return words, s, z


# An INT8 word's four products with the activations in one chain, for the GEMV at one row: code j goes into the
# low byte of the float 2^23 + zero (`prmt` takes its upper bytes, 0x4B0000, from that float: its bits are then
# 2^23 + code), the float 2^23 + zero is taken away (exact: a small integer), and the four products sum in code
# order, the first a plain product: the float32 route's values and roundings (`_minus_zero`, then `part += x *
# w`), in three instructions a weight where the compiler makes five or six of it. Inputs: the word, its four
# columns' activations (float32), 2^23 + zero (float32); output: the word's partial.
_INT8_GEMV_CODE = """
prmt.b32 v, $1, $6, 0x765J;
sub.f32 v, v, $6;
fma.rn.f32 $0, $X, v, $0;"""
INT8_GEMV_ASM = tl.constexpr(
    "{\n.reg .b32 v;"
    + "".join(_INT8_GEMV_CODE.replace("J", str(j)).replace("X", str(2 + j)) for j in range(4)).replace(
        "fma.rn.f32 $0, $2, v, $0", "mul.rn.f32 $0, $2, v"
    )
    + "\n}\n"
)


@triton.jit
def _x_runs(x_ptr, kp, HALF: tl.constexpr):
    """The activations of one row at the four columns of each INT8 word kp (`[W]`), float32: one 8-byte load a
    word (a run of four bf16 or fp16), split into its four values in the words' own layout (bf16: the bits
    shifted into a float's upper half)."""
    xq = tl.load(x_ptr.to(tl.pointer_type(tl.uint64)) + kp)
    lo = xq.to(tl.uint32)
    hi = (xq >> 32).to(tl.uint32)
    if HALF:
        x0 = lo.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        x1 = (lo >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        x2 = hi.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        x3 = (hi >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        x0 = (lo << 16).to(tl.float32, bitcast=True)
        x1 = ((lo >> 16) << 16).to(tl.float32, bitcast=True)
        x2 = (hi << 16).to(tl.float32, bitcast=True)
        x3 = ((hi >> 16) << 16).to(tl.float32, bitcast=True)
    return x0, x1, x2, x3


@triton.jit
def _gemv_products(
    x_rows, words, s, z, k0, row_ok, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """One K step of the GEMV over its words, scales and zero points (`_gemv_words`): float32 partials
    `[BLOCK_M, BLOCK_N, BLOCK_K / PACK]` (one row: `[BLOCK_N, BLOCK_K / PACK]`), one per packed word, each summing
    its PACK codes' products with the activations they meet. The words stay in the layout they were loaded in:
    code j of every word is taken in turn against the activations at columns `word * PACK + j` (a strided load
    of a row that sits in L1), so no tensor is reshaped (a reshape that splits the packed dimension costs a trip
    through shared memory)."""
    PACK: tl.constexpr = 32 // BITS
    kp = tl.multiple_of(k0 // PACK, BLOCK_K // PACK) + tl.arange(0, BLOCK_K // PACK)
    if BLOCK_M == 1 and BITS == 8 and ASM:  # x 8-byte aligned: a word's four products in one PTX chain
        x0, x1, x2, x3 = _x_runs(x_rows, kp, x_rows.dtype.element_ty == tl.float16)  # each [1, W]
        part = tl.inline_asm_elementwise(
            INT8_GEMV_ASM, "=r,r,r,r,r,r,r", [words, x0, x1, x2, x3, z + 8388608.0], tl.float32, is_pure=True,
            pack=1,
        )  # fmt: skip
        out = part * s
    elif BLOCK_M == 1:  # one row: everything in the words' own 2D layout, no layout conversion in the loop
        part = tl.zeros(words.shape, dtype=tl.float32)
        for j in tl.static_range(PACK):
            x = tl.load(x_rows + (kp * PACK + j)[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            part += x * _minus_zero(words, j, z, BITS)
        out = part * s
    else:
        part3 = tl.zeros((BLOCK_M, words.shape[0], BLOCK_K // PACK), dtype=tl.float32)
        for j in tl.static_range(PACK):
            x = tl.load(x_rows + (kp * PACK + j)[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            part3 += x[:, None, :] * _minus_zero(words, j, z, BITS)[None, :, :]
        out = part3 * s[None, :, :]
    return out


@triton.jit
def _dot_step(acc, x, w, SWAP_AB: tl.constexpr, IEEE: tl.constexpr):
    """acc + x `[M, k]` . w `[N, k]` on the tensor cores: `[M, N]`, or `[N, M]` (SWAP_AB); one return."""
    if SWAP_AB:
        a = w
        b = tl.trans(x)
    else:
        a = x
        b = tl.trans(w)
    if IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _wint_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    K_SPLIT,
    stride_x,
    stride_w,
    stride_s,
    stride_y,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
    SWAP_AB: tl.constexpr,
    IEEE: tl.constexpr,
    ASM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """y[split, m, n] = sum over this program's K_SPLIT columns of x[m, k] * dequant(w)[n, k] (+ b[n]) for one
    BLOCK_M x BLOCK_N tile. DOT: per step, the activations dotted with the codes minus their zero point (exact
    in x's dtype) on the tensor cores, times the group's scales (SWAP_AB: the tile computed transposed); else
    the GEMV's float32 partial products per thread, summed once at the end."""
    PACK: tl.constexpr = 32 // BITS
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    pdl_start(USE_PDL)
    if not DOT and BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K // PACK), dtype=tl.float32)
    elif not DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // PACK), dtype=tl.float32)
    elif SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if DOT and BLOCK_K // PACK >= 16:
        # A step's scales and zero points are loaded a step ahead: the codes come through cp.async (pipelined),
        # but these plain loads stalled each step for a memory latency (in SASS, the zero point's load met its
        # shared-memory store at once).
        s_next, z_next = _group_params(s_ptr, z_ptr, k_lo // GROUP, cols, col_ok, stride_s, BITS, HAS_ZERO)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # a step lies in one group or spans whole ones: no tail
        if not DOT:
            w, s, z = _gemv_words(
                w_ptr, s_ptr, z_ptr, k0, cols, col_ok, stride_w, stride_s, GROUP, BITS, HAS_ZERO, BLOCK_K
            )
            acc += _gemv_products(x_rows, w, s, z, k0, row_ok, BITS, BLOCK_M, BLOCK_K, ASM)
        elif BLOCK_K // PACK >= 16:  # each code position's columns make a dot of their own (K >= 16)
            kp = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
            words = tl.load(
                w_ptr + cols.to(tl.int64)[:, None] * stride_w + kp[None, :], mask=col_ok[:, None], other=0
            )
            s, z = s_next, z_next
            # the last step loads its own again
            g_next = tl.minimum(k0 + BLOCK_K, k_hi - BLOCK_K) // GROUP
            s_next, z_next = _group_params(s_ptr, z_ptr, g_next, cols, col_ok, stride_s, BITS, HAS_ZERO)
            step = tl.zeros(acc.shape, dtype=tl.float32)
            if BITS == 4:  # all eight codes of the words at once (two weights an instruction under ASM)
                ws = _int4_halves(words, z[:, None], x_ptr.dtype.element_ty, ASM)
                xs = _columns_by_code(x_rows, k0, row_ok, BLOCK_M, BLOCK_K)
                for j in tl.static_range(PACK):
                    step = _dot_step(step, xs[j], ws[j], SWAP_AB, IEEE)
            else:
                for j in tl.static_range(PACK):
                    x = tl.load(x_rows + (kp * PACK + j)[None, :], mask=row_ok[:, None], other=0.0)
                    w = _minus_zero(words, j, z[:, None], BITS).to(x.dtype)
                    step = _dot_step(step, x, w, SWAP_AB, IEEE)
            acc += step * (s[:, None] if SWAP_AB else s[None, :])
        else:  # a narrow step (a small group): the codes unpacked into their columns' order
            q = _codes(w_ptr, cols, k0 // PACK, stride_w, col_ok, BITS, BLOCK_N, BLOCK_K)
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
            s, z = _group_params(s_ptr, z_ptr, k0 // GROUP, cols, col_ok, stride_s, BITS, HAS_ZERO)
            w = (q - z.to(tl.int32)[:, None]).to(x.dtype)
            step = _dot_step(tl.zeros(acc.shape, dtype=tl.float32), x, w, SWAP_AB, IEEE)
            acc += step * (s[:, None] if SWAP_AB else s[None, :])
    if not DOT and BLOCK_M == 1:
        y = tl.sum(acc, axis=1)[None, :]
    elif not DOT:
        y = tl.sum(acc, axis=2)
    elif SWAP_AB:
        y = tl.trans(acc)
    else:
        y = acc
    ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT:  # the tile's last program to arrive sums the partials in split order
        part = part_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        last, y = split_sum(y, part, ok, M * N, count_ptr + tile)
        if last:
            _store_tile(y, b_ptr, y_ptr, rows, cols, col_ok, ok, stride_y, HAS_BIAS)
    else:
        _store_tile(y, b_ptr, y_ptr, rows, cols, col_ok, ok, stride_y, HAS_BIAS)


@triton.jit
def _store_tile(y, b_ptr, y_ptr, rows, cols, col_ok, ok, stride_y, HAS_BIAS: tl.constexpr):
    """A tile's float32 sums plus the bias, stored in y's dtype."""
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequantize_kernel(
    w_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    N,
    K,
    stride_w,
    stride_s,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """y[n, k] = (code - zero) * scale, in y's dtype, for one BLOCK_N x BLOCK_K tile (BLOCK_K divides GROUP)."""
    PACK: tl.constexpr = 32 // BITS
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    col_ok = cols < N
    pdl_start(USE_PDL)
    q = _codes(w_ptr, cols, k0 // PACK, stride_w, col_ok, BITS, BLOCK_N, BLOCK_K).to(tl.float32)
    s, z = _group_params(s_ptr, z_ptr, k0 // GROUP, cols, col_ok, stride_s, BITS, HAS_ZERO)
    w = (q - z[:, None]) * s[:, None]
    ks = k0 + tl.arange(0, BLOCK_K)
    tl.store(
        y_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :],
        w.to(y_ptr.dtype.element_ty),
        mask=col_ok[:, None],
    )


# ---- configs -------------------------------------------------------------------------------------------------


def step_k(group: int, cap: int = 128) -> int:
    """The K step: the largest power of two that divides the group, at most `cap` (at least 32: the group is a
    multiple of 32), so that a step lies in one group."""
    return min(cap, group & -group)


def _split(
    tiles: int, k: int, block_k: int, sms: int, min_steps: int = 4, most: int = 4, per_sm: int = 2
) -> int:
    """How many programs share K: enough that `tiles` output tiles times the splits give every multiprocessor
    at least `per_sm` programs, each keeping `min_steps` K steps, at most `most`; a power of two that divides K's
    steps evenly."""
    steps = k // block_k
    split = 1
    while (
        tiles * split < per_sm * sms
        and split < most
        and steps % (split * 2) == 0
        and steps // (split * 2) >= min_steps
    ):
        split *= 2
    return split


def gemv_config(
    m: int, n: int, k: int, group: int, sms: int = 132, ptx: bool = False
) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT, num_warps) for `wint_gemv`: one group (up to 128 columns) a step, four warps.

    `ptx` (INT8 at one row through the PTX chain, `gemv_ptx`): of 32, 64 and 128 weight rows a program, each with
    K split as far as one wave of programs holds (`GEMV_PTX_REGS`' registers a thread set the programs a
    multiprocessor; at most 16 ways, each part two steps or more), the one whose wave holds the most weight rows
    in flight; where level, the fewer rows a program (more warps). At the 8B shapes: qkv 64 rows split 8, o and
    down 128 rows split 16, gate_up 64 rows split 2, each the fastest or within 5% of the fastest of 23 tilings
    on the H200 (run 144), and the engine's INT8 batch 1 within 1.1% of every layer at its fastest (run 146).

    Else 64 weight rows a program (at one row), K split 8 ways where the tiles are fewer than two a
    multiprocessor and 4 ways where they are more (each part at least two steps). From the graph-timed sweep at
    one row (run 81, benchmarks/NOTES.md): the best tiling of INT4 and INT8 at the four 8B shapes but INT8's qkv
    (32 rows, 4 ways: 12.6 us against 13.3); run 72's defaults (512-column steps), set by Python-launch timings,
    were 1.1-2.0x slower."""
    block_m = triton.next_power_of_2(m)
    block_k = step_k(group)
    steps = k // block_k
    if ptx:
        best = (0, 0, 1)
        for block_n, regs in GEMV_PTX_REGS.items():
            fit = sms * (65536 // (regs * 128))  # programs a wave: the registers of four-warp programs
            tiles, split = triton.cdiv(n, block_n), 1
            while split < 16 and steps % (2 * split) == 0 and steps >= 4 * split and tiles * 2 * split <= fit:
                split *= 2
            best = max(best, (min(tiles * split, fit) * block_n, -block_n, split))  # rows in flight, warps
        return -best[1], block_k, best[2], 4
    block_n = max(4, 64 // block_m)
    tiles = triton.cdiv(n, block_n)
    split = 8 if tiles < 2 * sms else 4
    while split > 1 and (steps % split or steps // split < 2):
        split //= 2
    return block_n, block_k, split, 4


def gemm_config(m: int, n: int, k: int, group: int, sms: int = 132) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages) for `wint_gemm`: up to 32 rows a transposed
    tile (the weight rows, 128 or 64, on the tensor cores' 64-row side), then 64-row tiles.

    Up to 16 rows (run 87's graph-timed sweep, INT4 with zero points at the 8B shapes, the group's scale and
    zero point loaded a step ahead): two warps (mma.sync) and K split until there are three programs a
    multiprocessor (at most 8 ways; 16 on a long K loop): qkv 64-row tiles split 8 (9.9 / 10.9 us at 1 / 16
    rows), o 64 split 8 (9.4 / 10.2), gate_up 128 split 2 (32.5 / 32.0), down 128 split 16 (19.8 / 21.4),
    each within 1.5 us of the sweep's best. The four-warp tilings (wgmma) ran 30-90% slower at one row there:
    Triton compiles M = 1 apart (an argument equal to 1 is specialized), and that kernel lost. A program's
    time follows its count of K steps (run 84: 1.3 us a step at one program a multiprocessor), so the splits
    keep several programs a multiprocessor in flight. From 17 rows: four warps, two programs a multiprocessor
    (run 84)."""
    block_k = step_k(group)
    block_m = max(16, triton.next_power_of_2(m)) if m <= 32 else 64
    tiles_m = triton.cdiv(m, block_m)
    few = m <= 16
    long_k = k // block_k >= 64 and few  # down_proj's 112 steps: 128-row tiles, up to 16 splits
    block_n = 128 if triton.cdiv(n, 128) * tiles_m >= sms or long_k else 64
    most = 16 if long_k else 8
    split = _split(triton.cdiv(n, block_n) * tiles_m, k, block_k, sms, most=most, per_sm=3 if few else 2)
    return block_m, block_n, block_k, split, 2 if few else 4, 3


# ---- launchers -----------------------------------------------------------------------------------------------


def uses_asm(x: torch.Tensor, w: IntWeight) -> bool:
    """Whether the tensor-core kernel turns INT4 codes into halves with inline PTX (`_int4_halves`): INT4 with
    bf16 or fp16 activations on the device; Triton's interpreter, which cannot run PTX, takes the float32
    route to the same values."""
    return w.bits == 4 and x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda and not INTERPRET


def gemv_ptx(x: torch.Tensor, w: IntWeight) -> bool:
    """Whether the GEMV takes an INT8 word's products in one PTX chain (`INT8_GEMV_ASM`): one row of bf16 or
    fp16 on the device, 8-byte aligned (it reads the activations 8 bytes a word); `TINYPAGED_INT8_GEMV_PTX=0`
    sends every step the compiler's float32 route, the same values, for side-by-side measurements."""
    return (
        INT8_GEMV_PTX
        and w.bits == 8
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.is_cuda
        and not INTERPRET
        and x.data_ptr() % 8 == 0
    )


def gemv_rows(x: torch.Tensor, w: IntWeight) -> int:
    """The most rows a step sends to `wint_gemv`; from one more on, `wint_gemm` (tensor cores). On the device
    (run 84, graph-timed at the 8B shapes, K splits reduced in the same launch): INT4 takes the tensor cores
    from one row (qkv / o / gate_up / down 13.1 / 9.2 / 37.3 / 20.3 us against the GEMV's 14.6 / 9.2 / 42.4 /
    26.0 at their defaults); INT8 the GEMV at one row (its tensor-core route through float32 is the faster
    from two rows). Under Triton's interpreter: up to GEMV_MAX_ROWS."""
    if not x.is_cuda or INTERPRET:
        return GEMV_MAX_ROWS
    return 0 if uses_asm(x, w) else 1


def _check(x: torch.Tensor, w: IntWeight) -> tuple[int, int, int]:
    m, k = x.shape
    n = w.qweight.shape[0]
    assert w.bits in (4, 8) and w.group % 32 == 0 and k % w.group == 0, (w.bits, w.group, k)
    assert (
        w.qweight.dtype == torch.int32 and w.qweight.shape[1] * 32 == k * w.bits and w.qweight.stride(1) == 1
    )
    assert (
        w.scales.dtype == torch.float32 and w.scales.shape == (k // w.group, n) and w.scales.is_contiguous()
    )
    z = w.zeros
    assert z is None or (z.dtype == torch.uint8 and z.shape == w.scales.shape and z.is_contiguous())
    assert x.stride(1) == 1
    return m, n, k


def _launch(
    x: torch.Tensor,
    w: IntWeight,
    bias: torch.Tensor | None,
    tiles: tuple[int, int, int],
    split: int,
    warps: int,
    stages: int,
    dot: bool,
    asm: bool,
) -> torch.Tensor:
    """One launch of `_wint_kernel` over (BLOCK_M, BLOCK_N, BLOCK_K) `tiles`, K split `split` ways; `asm`: the
    kernel's ASM (`uses_asm` for the tensor-core kernel, `gemv_ptx` for the GEMV)."""
    m, n, k = _check(x, w)
    block_m, block_n, block_k = tiles
    # A step lies in one group, or (the GEMV, a power-of-two group) spans whole ones.
    spans = not dot and block_k % w.group == 0 and w.group & (w.group - 1) == 0
    assert (w.group % block_k == 0 or spans) and k % block_k == 0 and (k // block_k) % split == 0
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    if split > 1:
        assert grid[0] * grid[1] <= MAX_TILES and split * m * n < 2**31
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = tile_counters(x.device)
    else:
        part = counters = y
    s, z = w.scales, w.zeros
    _wint_kernel[grid](
        x, w.qweight, s, z if z is not None else s, bias if bias is not None else s, y, part, counters,
        m, n, k, k // split, x.stride(0), w.qweight.stride(0), s.stride(0), n,
        GROUP=w.group, BITS=w.bits, HAS_ZERO=z is not None, HAS_BIAS=bias is not None, SPLIT=split > 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot, SWAP_AB=block_m < 64,
        IEEE=x.dtype == torch.float32, ASM=asm, num_warps=warps,
        num_stages=stages, **pdl_options(x),
    )  # fmt: skip
    return y


def wint_gemv(
    x: torch.Tensor,
    w: IntWeight,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x `[M, K]` (M <= 4, rows contiguous) times the dequantized weight `w` (the module docstring's layout),
    transposed, plus bias `[N]`: `[M, N]` in x's dtype, products and sums in float32 (semantics:
    `model.quant.lowbit.ref_wint_linear`). `config`: (BLOCK_N, BLOCK_K, SPLIT, num_warps), default
    `gemv_config`."""
    m, k = x.shape
    assert 1 <= m <= GEMV_MAX_ROWS
    sms = num_sms(x.device) if x.is_cuda else 132
    ptx = gemv_ptx(x, w)
    block_n, block_k, split, warps = config or gemv_config(m, w.qweight.shape[0], k, w.group, sms, ptx)
    tiles = (triton.next_power_of_2(m), block_n, block_k)
    return _launch(x, w, bias, tiles, split, warps, 3, dot=False, asm=ptx)


def wint_gemm(
    x: torch.Tensor,
    w: IntWeight,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """As `wint_gemv`, for any row count (tensor cores; meant for up to 64 rows): `[M, N]` in x's dtype.
    `config`: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages), default `gemm_config`."""
    m, k = x.shape
    sms = num_sms(x.device) if x.is_cuda else 132
    block_m, block_n, block_k, split, warps, stages = config or gemm_config(
        m, w.qweight.shape[0], k, w.group, sms
    )
    return _launch(
        x, w, bias, (block_m, block_n, block_k), split, warps, stages, dot=True, asm=uses_asm(x, w)
    )


def wint_dequantize(w: IntWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight `[N, K]` in `dtype`: `(code - zero) * scale` in float32, rounded once to `dtype`."""
    n = w.qweight.shape[0]
    k = w.qweight.shape[1] * 32 // w.bits
    block_k, block_n = step_k(w.group), 32
    y = torch.empty((n, k), dtype=dtype, device=w.qweight.device)
    s, z = w.scales, w.zeros
    _dequantize_kernel[(triton.cdiv(n, block_n), k // block_k)](
        w.qweight, s, z if z is not None else s, y, n, k, w.qweight.stride(0), s.stride(0),
        GROUP=w.group, BITS=w.bits, HAS_ZERO=z is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        **pdl_options(w.qweight),
    )  # fmt: skip
    return y
