"""INT4 and INT8 weight-only matmuls of 1-16 rows on the tensor cores, the weights loaded straight into the MMA's
registers (Gluon, Triton's layout-explicit dialect): y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias), x in bf16 or
fp16, codes in groups of 128.

Why: the Triton kernel (`kernels/lowbit.py` `_wint_kernel`) loads the codes in a blocked layout, and Triton moves
the dequantized tile through shared memory into the MMA's operand layout every K step (stores, barriers, loads).
At one row it read 1.6-2.0 TB/s of INT4 bytes (benchmarks/NOTES.md, runs 84-108). Here each thread loads, with
plain vector loads, exactly the packed words whose codes are its own operand registers.

The layout is kernels/lowbit.py's (compressed-tensors' pack-quantized words, `PACK` = 32 / bits codes a word,
float32 scales `[K / group, N]`, uint8 zero points or none): nothing is repacked. The tile is computed
transposed, as the Triton kernel's (`SWAP_AB`): the weight rows on the 16-row side of `mma.sync` m16n8k16
(operand A), the token rows on its 8-column side (operand B, up to 16 rows in two tiles). A K step is 16 words
of each row (a group of 128 columns in INT4, half of one in INT8), and its dot splits into PACK dots of K = 16
by code position: dot j takes code j of every word (column `PACK * word + j`) against the activations at those
columns. In the A operand's layout (two consecutive K elements a register) a thread holds words (row, 2t),
(row, 2t + 1), (row, 2t + 8), (row, 2t + 9) of its rows: code j of a pair of words is one bf16x2 (fp16x2)
register of dot j's operand, made by inline PTX: code - zero, exact (INT4: kernels/lowbit.py's `prmt`, `lop3`
and a packed `fma`; INT8: `_INT8_ASM`). The activations of a step arrive as a `[16 words, M, PACK codes]` tile
(a thread's 2 x 2 x PACK columns of a row in 16-byte loads) and are split in registers into the PACK B
operands; each split is proved to be the operand's layout at compile time (`convert_layout(...,
assert_trivial=True)`). Float32 sums; the group's scale multiplies each step's sum: the numbers of the Triton
kernel, up to the order of float32 sums.

Latency: the weights never depend on the kernel before, so the first steps' words are asked for before the kernel
waits on it (programmatic dependent launch). Then two ways (`STAGES`):
- 0: each step loads the next one's words into registers while it computes. At one row the wide INT4 layers
  read 2.3-2.4 TB/s (run 113): by Little's law about what a multiprocessor's ~12 warps keep in flight that way
  (2 KB a warp, the next step's words, held in registers until they land) against HBM's latency under load.
  An INT4 layer's loads ask the L2 to fetch 128 bytes of the row (`ld.global.nc.L2::128B`): a step reads 64,
  so the next step's words come from the L2 (run 127, H100: gate_up at one row 33.2 -> 28.1 us). `WIDE` (INT4 up
  to 8 rows, the default: `MMA_WIDE`): a thread's four neighbouring words of a step in one 16-byte load, the
  step's words put in the MMA's k-slots in that order and the activations dealt to match (`_k_slots`).
- STAGES >= 2: the words come through a ring of STAGES steps in shared memory (16-byte `cp.async`, STAGES - 1
  steps in flight: 24 KB a program at 4), read into the A operand's registers with 8-byte shared loads. The
  bytes in flight hold no registers, as in the FP8 matmul (`kernels/fp8_gemm.py`), which reads gate_up at 3.8
  TB/s. The sums are the same, in the same order: the same bits either way.
K splits across programs as in kernels/lowbit.py: the tile's last program to arrive sums the float32 partials in
piece order, every piece's load in flight at once.

Measured on the H200: INT4 with STAGES 0 (runs 109-114, the default; the L2 hint from run 127, on an H100). The
ring is right and slower (run 114: INT4 batch 1 1.52x bf16 through the ring against 1.71x), so it stays off
(`MMA_STAGES`) for side-by-side measurements. INT8 is slower at one row than the Triton GEMV (run 114: batch 1
1.09x against 1.29x) and faster from two rows than the Triton tensor-core kernel (a layer's four at 2 / 8 / 16
rows 102.2 / 109.1 / 117.0 against 113.9 / 130.9 / 167.1 us on the H200, run 119; 127.0 / 136.1 / 140.8 against
128.5 / 143.4 / 177.9 on an H100, run 127): `model/quant/lowbit.py` sends it INT8 steps of 2-16 rows.

One job, past 450 lines: one kernel, its operands' layouts (each split proved trivial where it is made) and the
launcher that picks its tiling; split apart, the layouts would be read away from the loads they describe.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .fp8 import INTERPRET
from .fp8_gemm import MAX_TILES, tile_counters
from .lowbit import INT4_BF16_ASM, INT4_FP16_ASM, IntWeight
from .pdl import pdl_options, pdl_start

# Steps of packed words in the shared ring (cp.async), STAGES - 1 of them in flight; 0: the words straight into
# registers, one step ahead (measured: runs 109-114). TINYPAGED_INT4_MMA_STAGES sets it, for side-by-side
# measurements: the ring measured slower (run 114; benchmarks/NOTES.md, "INT4 in Gluon: the words through a
# shared ring").
MMA_STAGES = int(os.environ.get("TINYPAGED_INT4_MMA_STAGES", "0"))
# INT8 through this kernel (at the row counts `model/quant/lowbit.py` sends it: 2-16); TINYPAGED_INT8_MMA=0 sends
# INT8 to kernels/lowbit.py's GEMV and tensor-core kernel at every row count, for side-by-side measurements.
INT8_MMA = os.environ.get("TINYPAGED_INT8_MMA", "1") == "1"
# The L2 prefetch size of an INT4 layer's word loads on the registers path (STAGES 0): 0 (a plain load), 64, 128
# or 256 bytes (TINYPAGED_INT4_MMA_L2). A step reads 64 bytes of each row, the next step the 64 after them: asked
# with 128, the L2 fetches both from DRAM at once. Measured (H100, runs 123-128): a layer's four INT4 matmuls at
# one row 64.1 -> 58.8 us (gate_up 33.2 -> 28.1), batch-1 decode 337.2 -> 359.4 tok/s; 256 and 64 bytes no gain.
# INT8 layers load plainly: the hint slowed them at 2-8 rows. (Two steps' words in flight instead of one, tried
# beside it, lost: 155 registers a thread, a program a multiprocessor fewer; benchmarks/NOTES.md.)
MMA_L2 = int(os.environ.get("TINYPAGED_INT4_MMA_L2", "128"))
# An INT4 layer's words in 16-byte loads on the registers path (STAGES 0): thread t of a warp loads words 4t..4t + 3
# of a row's step (one load) where the A operand's layout gives it words 2t, 2t + 1, 2t + 8, 2t + 9 (two 8-byte
# loads), and the step's words sit in the MMA's k-slots in that order, the activations' columns dealt to match:
# the same products, summed in another order inside each MMA (the same bits as the pairs' on every check, runs
# 137-138). On by default up to 8 rows (TINYPAGED_INT4_MMA_WIDE=0: the pairs). Measured on H100s (runs 137-141): a
# layer's four 2-4% faster at 1, 2, 4 and 8 rows (one row 55.0-56.4 us against 57.3-58.8), batch 1 +1.6-2.0%
# (372.4-374.0 tok/s against 366.3-367.4, runs 138-141); at 16 rows slower (98.1 against 80.8 us, run 137).
MMA_WIDE = os.environ.get("TINYPAGED_INT4_MMA_WIDE", "1") == "1"
GROUP = gl.constexpr(128)  # the columns of a group of codes, the one group size the kernel takes

# Four INT8 codes a word into half-precision pairs: code j of two neighbouring words goes into the low byte of
# the float 2^23 + zero (`prmt`: its upper three bytes, 0x4B0000, are 2^23's; the float's bits are then 2^23 +
# code), the float 2^23 + zero is taken away (exact: a small integer), and the pair becomes one bf16x2 (fp16x2)
# register (`cvt.rn`, exact). Inputs: the two words, then 2^23 + zero (float32) twice; outputs: codes 0-3.
_INT8_CODE = """
prmt.b32 f0, $4, $6, 0x765J;
prmt.b32 f1, $5, $6, 0x765J;
sub.f32 f0, f0, $6;
sub.f32 f1, f1, $6;
cvt.rn.TY.f32 $J, f1, f0;"""
_INT8_ASM = "{\n.reg .b32 f0, f1;" + "".join(_INT8_CODE.replace("J", str(j)) for j in range(4)) + "\n}\n"
INT8_BF16_ASM = gl.constexpr(_INT8_ASM.replace("TY", "bf16x2"))
INT8_FP16_ASM = gl.constexpr(_INT8_ASM.replace("TY", "f16x2"))


# A thread's VEC neighbouring words (8 or 16 bytes) through the read-only path, asking the L2 to fetch SIZE bytes
# around them from DRAM (`.L2::SIZEB`, sm_75 and later).
@gluon.constexpr_function
def _words_l2_asm(size, vec):
    """The load's PTX and constraints: VEC outputs, then VEC pointers (the first one's address is used)."""
    outs = ", ".join(f"${i}" for i in range(vec))
    asm = f"ld.global.nc.L2::{size}B.v{vec}.u32 {{{outs}}}, [${vec}];"
    return gl.constexpr(asm), gl.constexpr(",".join(["=r"] * vec + ["l"] * vec))


@gluon.constexpr_function
def _wide_words_layout(block_n, warps):
    """`[BLOCK_N, 16]` words with thread t of a warp holding words 4t..4t + 3 of its rows in consecutive registers:
    the A operand's layout (`to_linear_layout` of it: registers k + 1, row + 8, k + 8, then the 16-row tiles a warp;
    lanes k + 2, k + 4, rows + 1, + 2, + 4; warps 16 rows each) with its k-slots relabelled (`_k_slots`)."""
    reps = block_n // (16 * warps)
    regs = [[0, 1], [0, 2], [8, 0]] + [[(16 * warps) << i, 0] for i in range(reps.bit_length() - 1)]
    lanes = [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]]
    warp_bases = [[16 << i, 0] for i in range(warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=regs, lane_bases=lanes, warp_bases=warp_bases, block_bases=[], shape=[block_n, 16]
    )


@gluon.jit
def _k_slots(t, axis: gl.constexpr):
    """A step's 16 words (along `axis`, 0 or 1 of a 2-D or 3-D tensor) in k-slot order: word 4a + 2h + p goes to
    k-slot 8h + 2a + p, so that the k-slots a thread holds in the A operand (2a, 2a + 1, 2a + 8, 2a + 9) are
    its words 4a..4a + 3."""
    if axis == 0:  # [16, M, 8]
        t = gl.reshape(t, [4, 2, 2, t.shape[1], t.shape[2]])
        t = gl.reshape(gl.permute(t, [1, 0, 2, 3, 4]), [16, t.shape[3], t.shape[4]])
    else:  # [BLOCK_N, 16]
        t = gl.reshape(t, [t.shape[0], 4, 2, 2])
        t = gl.reshape(gl.permute(t, [0, 2, 1, 3]), [t.shape[0], 16])
    return t


@gluon.jit
def _load_words(w_ptr, rows, row_ok, word0, stride_w, cols, L2: gl.constexpr, VEC: gl.constexpr):
    """Words `cols` from `word0` of weight rows `rows`, in the layout of `rows` and `cols`. L2 > 0: by inline PTX
    with that L2 prefetch size, VEC neighbouring words a load, rows past N read as row 0 (their sums are never
    stored)."""
    if L2 == 0:
        offs = rows.to(gl.int64)[:, None] * stride_w + (word0 + cols)[None, :]
        return gl.load(w_ptr + offs, mask=row_ok[:, None], other=0)
    else:
        ASM: gl.constexpr = _words_l2_asm(L2, VEC)[0]
        ARGS: gl.constexpr = _words_l2_asm(L2, VEC)[1]
        safe = gl.where(row_ok, rows, 0)
        ptrs = w_ptr + (safe.to(gl.int64)[:, None] * stride_w + (word0 + cols)[None, :])
        return gl.inline_asm_elementwise(ASM, ARGS, [ptrs], gl.int32, is_pure=True, pack=VEC)


@gluon.jit
def _words(w_ptr, rows, row_ok, k0, stride_w, wcols, PACK: gl.constexpr, L2: gl.constexpr):
    """One step's packed words `[BLOCK_N, 16]` (from column k0), in the A operand's layout: a pair of neighbouring
    words (2t, 2t + 1) a load."""
    return _load_words(w_ptr, rows, row_ok, k0 // PACK, stride_w, wcols, L2, 2)


@gluon.jit
def _words_wide(
    w_ptr, k0, pid_n, N, stride_w, a_layout: gl.constexpr, w_layout: gl.constexpr, L2: gl.constexpr
):
    """An INT4 step's packed words `[BLOCK_N, 16]` in 16-byte loads (`w_layout`: four neighbouring words a thread),
    relabelled into the A operand's layout by k-slot (`_k_slots`): a relabelling of registers, proved so at compile
    time."""
    rows = pid_n * w_layout.shape[0] + gl.arange(0, w_layout.shape[0], layout=gl.SliceLayout(1, w_layout))
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, w_layout))
    word0 = gl.multiple_of(k0 // 8, 16)  # a step's words start 64-byte aligned: 16-byte loads
    w = _load_words(w_ptr, rows, rows < N, word0, stride_w, cols, L2, 4)
    return gl.convert_layout(_k_slots(w, 1), a_layout, assert_trivial=True)


@gluon.jit
def _copy_words(slot, w_ptr, crows, crow_ok, ccols, k0, stride_w, live, PACK: gl.constexpr):
    """Ask for one step's packed words `[BLOCK_N, 16]` into a slot of the shared ring (16-byte cp.async, a thread
    four words of a row) as one commit group; `live` False (a step past the piece's end) copies nothing but
    still commits, so that the groups keep counting steps."""
    word0 = gl.multiple_of(k0 // PACK, 16)  # a step's words start 64-byte aligned: 16-byte copies
    offs = crows.to(gl.int64)[:, None] * stride_w + (word0 + ccols)[None, :]
    ok = (crow_ok & live)[:, None] & (ccols < 16)[None, :]
    async_copy.async_copy_global_to_shared(slot, w_ptr + offs, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _params(s_ptr, z_ptr, g, srows, zrows, N, sym_zero, HAS_ZERO: gl.constexpr):
    """Group g's scales (the accumulator's row layout) and zero points (the A operand's row layout; symmetric:
    `sym_zero`, 2^(bits - 1), a kernel argument rather than a constant: INT8's PTX takes 2^23 + zero in a
    register, and a constant there is folded into every use and moved into a register again for each, 53 moves
    a step in SASS)."""
    s = gl.load(s_ptr + g * N + srows, mask=srows < N, other=0.0)
    if HAS_ZERO:
        z = gl.load(z_ptr + g * N + zrows, mask=zrows < N, other=0).to(gl.float32)
    else:
        z = gl.full(zrows.shape, 0.0, gl.float32, zrows.type.layout) + sym_zero.to(gl.float32)
    return s, z


@gluon.jit
def _x_tile(x_rows, m_ok, k0, xw, xj):
    """The activations of one step as runs of 8 columns `[RUNS, BLOCK_M, 8]`: column `k0 + 8 * run + c` of each
    row (INT4: a run is a word's 8 codes, 16 runs; INT8: two words' 4 codes each, 8 runs). A thread's columns of
    a row are two runs of 16 (words 2t, 2t + 1 and 2t + 8, 2t + 9 for INT4) or of 8 (INT8): 16-byte loads."""
    offs = k0 + 8 * xw[:, None, None] + xj[None, None, :]
    return gl.load(x_rows[None, :, None] + offs, mask=m_ok[None, :, None], other=0.0)


@gluon.jit
def _columns8(x, b_layout: gl.constexpr):
    """An INT4 step's activations dealt by code position, in registers: eight `[16, BLOCK_M]` B operands,
    operand j holding columns `8 * word + j`."""
    x = gl.reshape(x, [16, x.shape[1], 2, 2, 2])  # j = 4a + 2b + c
    e, o = gl.split(x)
    e0, e1 = gl.split(e)
    o0, o1 = gl.split(o)
    x0, x4 = gl.split(e0)
    x2, x6 = gl.split(e1)
    x1, x5 = gl.split(o0)
    x3, x7 = gl.split(o1)
    return (
        gl.convert_layout(x0, b_layout, assert_trivial=True),
        gl.convert_layout(x1, b_layout, assert_trivial=True),
        gl.convert_layout(x2, b_layout, assert_trivial=True),
        gl.convert_layout(x3, b_layout, assert_trivial=True),
        gl.convert_layout(x4, b_layout, assert_trivial=True),
        gl.convert_layout(x5, b_layout, assert_trivial=True),
        gl.convert_layout(x6, b_layout, assert_trivial=True),
        gl.convert_layout(x7, b_layout, assert_trivial=True),
    )


@gluon.jit
def _columns4(x, b_layout: gl.constexpr):
    """An INT8 step's activations `[8 runs, BLOCK_M, 8]` (run r's column c: word 2r + c // 4, code c % 4) dealt by
    code position: four `[16 words, BLOCK_M]` B operands, operand j holding columns `4 * word + j`."""
    x = gl.reshape(x, [8, x.shape[1], 2, 2, 2])  # c = 4 * (word - 2r) + 2a + b, code j = 2a + b
    e, o = gl.split(x)
    x0, x2 = gl.split(e)
    x1, x3 = gl.split(o)
    return (_words_k(x0, b_layout), _words_k(x1, b_layout), _words_k(x2, b_layout), _words_k(x3, b_layout))


@gluon.jit
def _words_k(x, b_layout: gl.constexpr):
    """`[8 runs, BLOCK_M, 2 words]` as the B operand `[16 words, BLOCK_M]` (word 2r + w): a relabelling of
    registers, proved so at compile time."""
    x = gl.reshape(gl.permute(x, [0, 2, 1]), [16, x.shape[1]])
    return gl.convert_layout(x, b_layout, assert_trivial=True)


@gluon.jit
def _columns(x, b_layout: gl.constexpr, PACK: gl.constexpr):
    if PACK == 8:
        out = _columns8(x, b_layout)
    else:
        out = _columns4(x, b_layout)
    return out


@gluon.jit
def _step(acc, words, s, z, xs, BITS: gl.constexpr):
    """acc + one step's dots (one by code position) times the group's scales."""
    DT: gl.constexpr = xs[0].dtype
    if BITS == 4:
        if DT == gl.bfloat16:  # the codes' magic half: bf16 128, fp16 1024 (one unit a step there)
            ASM4: gl.constexpr = INT4_BF16_ASM
            MAGIC: gl.constexpr = 128.0
        else:
            ASM4: gl.constexpr = INT4_FP16_ASM
            MAGIC: gl.constexpr = 1024.0
        words, neg = gl.broadcast(words, (0.0 - (z + MAGIC)).to(DT)[:, None])
        ws = gl.inline_asm_elementwise(
            ASM4, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [words, neg], (neg.dtype,) * 8, is_pure=True, pack=2
        )
    else:
        if DT == gl.bfloat16:
            ASM8: gl.constexpr = INT8_BF16_ASM
        else:
            ASM8: gl.constexpr = INT8_FP16_ASM
        words, magic = gl.broadcast(words, (z + 8388608.0)[:, None])  # 2^23 + zero, float32
        ws = gl.inline_asm_elementwise(
            ASM8, "=r,=r,=r,=r,r,r,r,r", [words, magic], (xs[0].dtype,) * 4, is_pure=True, pack=2
        )
    step = gl.zeros_like(acc)
    for j in gl.static_range(32 // BITS):
        step = mma_v2(ws[j], xs[j], step)
    return acc + step * s[:, None]


@gluon.jit
def _wint_mma_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, K_SPLIT, stride_x, stride_w, stride_y, sym_zero,
    BITS: gl.constexpr, HAS_ZERO: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr, STAGES: gl.constexpr, L2: gl.constexpr,
    WIDE: gl.constexpr, USE_PDL: gl.constexpr,
):  # fmt: skip
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    PACK: gl.constexpr = 32 // BITS
    STEP_K: gl.constexpr = 16 * PACK  # the columns of a step: 16 words of each row

    pid_n = gl.program_id(0)
    split = gl.program_id(1)
    k_lo = split * K_SPLIT
    steps = K_SPLIT // STEP_K

    rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))
    row_ok = rows < N
    wcols = gl.arange(0, 16, layout=gl.SliceLayout(0, a_layout))
    srows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    # The activations' step tile [RUNS, BLOCK_M rows, 8 columns] (`_x_tile`): a thread holds a row's words 2t,
    # 2t + 1 (and 2t + 8, 2t + 9) whole, so that split by code position each is the B operand's layout.
    X_M: gl.constexpr = [[0, 8, 0]] if BLOCK_M == 16 else []
    # INT4: 16 runs of a word each; WIDE: in word order, run bits 0 and 1 in registers, 2 and 3 the lane's t
    # (`_k_slots` then deals them into k-slots); else run bits 0 and 3 in registers, 1 and 2 the lane's t.
    if PACK == 8 and WIDE:
        RUNS: gl.constexpr = 16
        X_REGS: gl.constexpr = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [1, 0, 0], [2, 0, 0]] + X_M
        X_RUN_LANES: gl.constexpr = [[4, 0, 0], [8, 0, 0]]
    elif PACK == 8:
        RUNS: gl.constexpr = 16
        X_REGS: gl.constexpr = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [1, 0, 0], [8, 0, 0]] + X_M
        X_RUN_LANES: gl.constexpr = [[2, 0, 0], [4, 0, 0]]
    else:  # 8 runs of two words: run bits 0 and 1 the lane's t, bit 2 in registers
        RUNS: gl.constexpr = 8
        X_REGS: gl.constexpr = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [4, 0, 0]] + X_M
        X_RUN_LANES: gl.constexpr = [[1, 0, 0], [2, 0, 0]]
    X_WARPS: gl.constexpr = [[0, 0, 0]] * (WARPS.bit_length() - 1)
    x_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=X_REGS,
        lane_bases=X_RUN_LANES + [[0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=X_WARPS,
        block_bases=[],
        shape=[RUNS, BLOCK_M, 8],
    )
    xw = gl.arange(0, RUNS, layout=gl.SliceLayout(1, gl.SliceLayout(2, x_layout)))
    xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(2, x_layout)))
    xj = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, x_layout)))
    m_ok = xm < M
    x_rows = x_ptr + xm.to(gl.int64) * stride_x

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    if STAGES == 0:
        # The words straight into registers: the first step's words and parameters are asked for before the
        # wait on the kernel before; then each step asks for the next one's while it computes. WIDE: the words
        # in 16-byte loads and each step's k-slots in their order (`_words_wide`, `_k_slots`).
        w_layout: gl.constexpr = _wide_words_layout(BLOCK_N, WARPS)
        if WIDE:
            w = _words_wide(w_ptr, k_lo, pid_n, N, stride_w, a_layout, w_layout, L2)
        else:
            w = _words(w_ptr, rows, row_ok, k_lo, stride_w, wcols, PACK, L2)
        s, z = _params(s_ptr, z_ptr, k_lo // GROUP, srows, rows, N, sym_zero, HAS_ZERO)
        pdl_start(USE_PDL)
        for i in range(steps):
            k0 = k_lo + i * STEP_K
            kn = k_lo + gl.minimum(i + 1, steps - 1) * STEP_K  # the last step asks for its own again
            if WIDE:
                w_next = _words_wide(w_ptr, kn, pid_n, N, stride_w, a_layout, w_layout, L2)
                xs = _columns(_k_slots(_x_tile(x_rows, m_ok, k0, xw, xj), 0), b_layout, PACK)
            else:
                w_next = _words(w_ptr, rows, row_ok, kn, stride_w, wcols, PACK, L2)
                xs = _columns(_x_tile(x_rows, m_ok, k0, xw, xj), b_layout, PACK)
            s_next, z_next = _params(s_ptr, z_ptr, kn // GROUP, srows, rows, N, sym_zero, HAS_ZERO)
            acc = _step(acc, w, s, z, xs, BITS)
            w, s, z = w_next, s_next, z_next
    else:
        # The words through a ring of STAGES steps in shared memory, STAGES - 1 steps in flight (cp.async): bytes
        # in flight that hold no registers. A row's 16 words in four 16-byte units, unit u of row r stored at
        # u ^ (r % 4), so that a warp's 8-byte reads in the A operand's layout meet no bank twice.
        ring_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=4, order=[1, 0])
        copy_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [WARPS, 1], [1, 0])
        ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 16], ring_layout)
        crows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy_layout))
        crow_ok = crows < N
        ccols = gl.arange(0, 16, layout=gl.SliceLayout(0, copy_layout))
        # The first STAGES - 1 steps' words and the first step's parameters before the wait on the kernel before.
        for p in gl.static_range(STAGES - 1):
            _copy_words(
                ring.index(p), w_ptr, crows, crow_ok, ccols, k_lo + p * STEP_K, stride_w, p < steps, PACK
            )
        s, z = _params(s_ptr, z_ptr, k_lo // GROUP, srows, rows, N, sym_zero, HAS_ZERO)
        pdl_start(USE_PDL)
        for i in range(steps):
            k0 = k_lo + i * STEP_K
            async_copy.wait_group(STAGES - 2)  # this thread's copies of step i are in
            gl.thread_barrier()  # everyone's are; and step i - 1's slot has been read by all
            w = ring.index(i % STAGES).load(a_layout)
            ahead = i + STAGES - 1  # into step i - 1's slot
            _copy_words(
                ring.index(ahead % STAGES), w_ptr, crows, crow_ok, ccols, k_lo + ahead * STEP_K, stride_w,
                ahead < steps, PACK,
            )  # fmt: skip
            kn = k_lo + gl.minimum(i + 1, steps - 1) * STEP_K
            s_next, z_next = _params(s_ptr, z_ptr, kn // GROUP, srows, rows, N, sym_zero, HAS_ZERO)
            acc = _step(acc, w, s, z, _columns(_x_tile(x_rows, m_ok, k0, xw, xj), b_layout, PACK), BITS)
            s, z = s_next, z_next
        async_copy.wait_group(0)  # no copy left in flight at exit (the ones past the end copy nothing)

    out_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    ok = (srows < N)[:, None] & (out_rows < M)[None, :]
    if SPLIT > 1:  # kernels/fp8_gemm.py's `split_sum` in Gluon (its `tl.zeros` has no layout to give here)
        part = part_ptr + out_rows.to(gl.int64)[None, :] * N + srows[:, None]
        gl.store(part + split * M * N, acc, mask=ok)
        gl.thread_barrier()
        last = gl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        if last:
            total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
            for p in gl.static_range(SPLIT):  # every piece's load in flight at once, summed in piece order
                total += gl.load(part + p * M * N, mask=ok, other=0.0, cache_modifier=".cg")
            gl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")
            _store(total, b_ptr, y_ptr, srows, out_rows, ok, N, stride_y, HAS_BIAS)
    else:
        _store(acc, b_ptr, y_ptr, srows, out_rows, ok, N, stride_y, HAS_BIAS)


@gluon.jit
def _store(acc, b_ptr, y_ptr, srows, out_rows, ok, N, stride_y, HAS_BIAS: gl.constexpr):
    """The transposed tile `[BLOCK_N, BLOCK_M]` (plus the bias) stored into y `[M, N]` in y's dtype."""
    if HAS_BIAS:
        acc = acc + gl.load(b_ptr + srows, mask=srows < N, other=0.0).to(gl.float32)[:, None]
    y = y_ptr + out_rows.to(gl.int64)[None, :] * stride_y + srows[:, None]
    gl.store(y, acc.to(y_ptr.dtype.element_ty), mask=ok)


def takes(x: torch.Tensor, w: IntWeight) -> bool:
    """Whether the layer and the activations are the kernel's: INT4 (INT8 too where `INT8_MMA` is on) in groups of
    128 with contiguous codes, scales and zero points and no GGUF mins, bf16 or fp16 activations (`usable` adds
    the device)."""
    return (
        (w.bits == 4 or (w.bits == 8 and INT8_MMA))
        and w.group == GROUP.value
        and w.mins is None
        and all(t is None or t.is_contiguous() for t in (w.qweight, w.scales, w.zeros))
        and x.dtype in (torch.bfloat16, torch.float16)
    )


def usable(x: torch.Tensor, w: IntWeight) -> bool:
    """Whether `wint_mma` takes this layer (`takes`) on x's device: an NVIDIA GPU of compute capability 8.0 or
    later (mma.sync), not under Triton's interpreter (which cannot run Gluon). `TINYPAGED_INT4_MMA=0` (read once a
    process) turns it off: the Triton kernel then runs."""
    return takes(x, w) and x.is_cuda and _runs_on(x.device.index if x.device.index is not None else -1)


@functools.cache
def _runs_on(device_index: int) -> bool:
    """The device half of `usable`, once a process and device (it is asked at every quantized layer of a step)."""
    if INTERPRET or os.environ.get("TINYPAGED_INT4_MMA", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device_index if device_index >= 0 else None)[0] >= 8


# Registers a thread of the INT4 kernel at 9-16 rows (16-row tiles, the words in registers), by (bits, 16-row
# tiles a warp): the more of its two schemes (zero points or not), compiled for sm_90 (`cuobjdump -res-usage`;
# tests/test_kernel_compiles.py holds the compiler to them). They set how many programs a multiprocessor holds,
# so the split that keeps a layer's programs in one wave.
REGS_16 = {(4, 1): 115, (4, 2): 168}
SM_REGS = 64 * 1024


def mma_config(m: int, n: int, k: int, sms: int = 132, bits: int = 4) -> tuple[int, ...]:
    """(BLOCK_N, WARPS, SPLIT, STAGES, L2), the words straight into registers (`MMA_STAGES` 0; an INT4 layer's
    loads asking the L2 for `MMA_L2` bytes) or through a ring of that many steps in shared memory.

    Up to 8 rows: four warps of two 16-row weight tiles (128 weight rows a program), K split until the programs
    are about three a multiprocessor (each piece at least two steps of 16 words a row). The split from run 110's
    graph-timed INT4 sweep at one row (benchmarks/int4_mma.py), within 0.1 us of the best tiling but o_proj's (6.7
    against 6.1 us): qkv split 8 (8.0 us), o 16 (6.7), gate_up 2 (25.0), down 16 (13.4). Steps of two groups, the
    zero points folded into the column sums and 8 or 16 rows a warp were slower or no faster (NOTES.md).

    INT4 from 9 rows (16-row tiles, words in registers): a thread's registers (`REGS_16`) leave fewer programs a
    multiprocessor, and a split past them runs in two waves (run 127: 1.4-1.8x the 8-row time). Of one weight tile
    a warp (eight warps, 128 rows) and two (four warps), the tiling with the most warps in flight in one wave, K
    split as far as that wave holds; two tiles where level. Run 129's 16-row sweep (H100) has each layer within
    0.9 us of its best; a layer's four 84.9 us against 103.2 at the 8-row rule and the Triton kernel's 88.2 (run
    130; on the H200 82.8 against 75.4, run 133, so the engine sends 9-16 rows to the Triton kernel:
    model/quant/lowbit.py's MMA_ROWS). INT8 keeps the 8-row rule: its four layers at 16 rows 143.4 us (run 129)
    against 154.6 at this one, and batch 16 4% slower (run 130)."""
    steps = k // (16 * (32 // bits))
    l2 = MMA_L2 if bits == 4 else 0

    def can_split(split: int) -> bool:  # twice `split`: pieces of at least two steps, dividing K's steps
        return steps % (split * 2) == 0 and steps // (split * 2) >= 2

    if m > 8 and bits == 4 and MMA_STAGES == 0:
        best: tuple[int, ...] = ()
        for reps, warps in ((2, 4), (1, 8)):  # two tiles first: kept where level
            block_n = 16 * reps * warps
            fits = sms * (SM_REGS // (REGS_16[bits, reps] * 32 * warps))  # programs in one wave
            tiles, split = triton.cdiv(n, block_n), 1
            while tiles * split * 2 <= fits and can_split(split):
                split *= 2
            in_flight = min(tiles * split, fits) * warps
            if not best or in_flight > best[0]:
                best = (in_flight, block_n, warps, split)
        return (*best[1:], 0, l2)
    tiles, split = triton.cdiv(n, 128), 1
    while tiles * split < 2.9 * sms and can_split(split):
        split *= 2
    return 128, 4, split, MMA_STAGES, l2


def full_config(m: int, n: int, k: int, bits: int, config: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """`config` (default `mma_config`'s) with what it leaves out filled in: the L2 size `mma_config`'s, WIDE
    `MMA_WIDE` on INT4 with STAGES 0 up to 8 rows."""
    cfg = tuple(config or mma_config(m, n, k, bits=bits))
    if len(cfg) == 4:  # no L2 size given: the default's
        cfg += mma_config(m, n, k, bits=bits)[4:]
    if len(cfg) == 5:  # no word width given: the default's
        cfg += (MMA_WIDE and bits == 4 and cfg[3] == 0 and m <= 8,)
    return cfg


def wint_mma(
    x: torch.Tensor,
    w: IntWeight,
    bias: torch.Tensor | None = None,
    config: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for 1-16 rows of bf16 / fp16 x and a layer `takes` accepts
    (`model/quant/lowbit.py` sends it up to MMA_ROWS). `config`: (BLOCK_N, WARPS, SPLIT, STAGES[, L2[, WIDE]]),
    default `mma_config`, what it leaves out filled in by `full_config`. Allocates with torch.empty only and never
    reads a value back: CUDA graphs capture it."""
    m, k = x.shape
    n = w.qweight.shape[0]
    pack = 32 // w.bits
    assert 1 <= m <= 16 and x.stride(1) == 1 and takes(x, w) and w.qweight.shape[1] * pack == k
    block_n, warps, split, stages, l2, wide = full_config(m, n, k, w.bits, config)
    assert block_n % (16 * warps) == 0 and (k // (16 * pack)) % split == 0 and stages != 1
    assert l2 in (0, 64, 128, 256) and (not wide or (w.bits == 4 and stages == 0))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n, block_n)
    if split > 1:
        assert tiles <= MAX_TILES
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = tile_counters(x.device)
    else:
        part = counters = y
    s, z = w.scales, w.zeros
    _wint_mma_kernel[(tiles, split)](
        x, w.qweight, s, z if z is not None else s, bias if bias is not None else s,
        y, part, counters, m, n, k, k // split, x.stride(0), w.qweight.stride(0), y.stride(0), 1 << (w.bits - 1),
        BITS=w.bits, HAS_ZERO=z is not None, HAS_BIAS=bias is not None, SPLIT=split, BLOCK_M=8 if m <= 8 else 16,
        BLOCK_N=block_n, WARPS=warps, STAGES=stages, L2=l2, WIDE=bool(wide), num_warps=warps, **pdl_options(x),
    )  # fmt: skip
    return y
