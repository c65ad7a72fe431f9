"""Decode attention over an FP8 (E4M3) paged KV cache with the K and V tiles loaded straight into the tensor cores'
registers (Gluon, Triton's layout-explicit dialect): one new token a sequence, no sliding window.

Why: the Triton kernel (kernels/attention.py) takes the E4M3 tile through shared memory and reads it back a byte
at a time before its dots (run 63: half of bf16's bytes in 73-81% of bf16's time, bound by instructions). Here a
warp loads, in 16-byte runs, exactly the bytes of its own `mma.sync` m16n8k16 operand registers and converts
them there (`cvt.rn.f16x2.e4m3x2`, two values an instruction); no shared memory is touched.

One warp a program: a (KV head, sequence, split). Its 16 rows are the G query heads sharing the KV head (the
rest padding), in fp16 (bf16 queries are made fp16, as the Triton kernel does: E4M3 converts to fp16 in one
instruction); float32 sums and online softmax in base 2, as the Triton kernel.
- S = Q K^T, K^T the B operand (`[HEAD_DIM, BLOCK_N]`). A thread holds, for key g of each 8-key tile, the head
  dimensions {2t, 2t + 1, 2t + 8, 2t + 9} of each 16-wide step. Q and K take the head dimension in the same
  permuted order, which leaves the sum unchanged: dimension `d = b0 + 2t + 8 b1 + 16 s` of the dot is byte
  `b0 + 2 b1 + 4 s + (HEAD_DIM / 4) t` of the row, so a thread's bytes of a key are one run of HEAD_DIM / 4.
- O = P V, P in registers (the accumulator's layout is the A operand's), V the B operand (`[BLOCK_N,
  HEAD_DIM]`): a thread holds keys {2t, 2t + 1, 2t + 8, 2t + 9} at output dimension g of each 8-wide tile. O's
  dimensions are permuted (output column `8 j + g` is byte `(HEAD_DIM / 8) g + j` of V's row), so that a thread's
  bytes of a key are one run of HEAD_DIM / 8; the store puts each column back.
The raw tiles are loaded in layouts whose relabelling (`reshape`, `permute`) is the operand's layout, proved at
compile time (`convert_layout(..., assert_trivial=True)`). k_scale is in the softmax scale, v_scale multiplies
the output once. With several splits a program writes kernels/attention.py's float32 partials, which its
`_reduce_kernel` combines.

Checked and timed on the H200 (runs 114-121): right; from 64 sequences 66-72% of bf16's time at its best split
(the Triton tile 76-80%); on ragged batches taken longest first (the engine's) its split rule is within 3% of its
best split from 128 sequences (run 119). In the engine the KV-bound workload ran 1.245x bf16 KV against 1.177x
through the Triton kernel, W1 with FP8 weights and KV 1.349x against 1.326x (runs 120, 121). Slower at 1-16
sequences over short contexts, where launches of fewer than `MIN_PROGRAMS` programs stay on the Triton kernel.
On by default (`FP8_DECODE_MMA`; TINYPAGED_FP8_ATTN_MMA=0 turns it off; benchmarks/NOTES.md, "FP8 decode attention
straight into registers").
"""

from __future__ import annotations

import functools
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .attention_configs import decode_program, num_sms, splits_for_programs
from .fp8 import INTERPRET
from .pdl import pdl_options, pdl_start

# Decode steps over an FP8 cache through this kernel (on unless TINYPAGED_FP8_ATTN_MMA=0); off, the Triton kernel
# runs them.
FP8_DECODE_MMA = os.environ.get("TINYPAGED_FP8_ATTN_MMA", "1") == "1"
# Launches of fewer programs (sequences x KV heads) stay on the Triton kernel: on ragged batches of 1-16
# sequences over up to 900 keys it took 1-3 us less a launch (run 119), and batch-1 decode over an FP8 cache ran
# 3.4% slower through this kernel (run 121). From 32 sequences (8 KV heads) up this kernel is ahead.
MIN_PROGRAMS = 256
# One-warp programs resident a multiprocessor, for the split choice: 168 registers a thread (SASS, head_dim
# 128) leave room for 12; the sweep should measure it. A split launch is held to SPLIT_MAXNREG registers, so
# that they fit: at head_dim 128 with 8 or 16 query heads a KV head it would take 174-176 (11 programs), and
# at 4 it spills 8 bytes without the cap, none with it (SASS, session fifteen).
PROGRAMS_PER_SM = 12
SPLIT_MAXNREG = 65536 // (32 * PROGRAMS_PER_SM) // 8 * 8  # 168
BLOCK_N = 32  # keys a step
_NEG_BIG = gl.constexpr(-1.0e30)  # kernels/attention.py's finite minus infinity for the running max


@gluon.jit
def _key_rows(bt_row, keys, seq_len, kv_head_off, stride_kb, stride_kt, BLOCK_SIZE: gl.constexpr):
    """The cache offsets of keys' rows (this KV head) through the block table; keys past seq_len masked."""
    ok = keys < seq_len
    block = gl.load(bt_row + keys // BLOCK_SIZE, mask=ok, other=0).to(gl.int64)
    return block * stride_kb + (keys % BLOCK_SIZE).to(gl.int64) * stride_kt + kv_head_off, ok


@gluon.jit
def _k_operand(raw, b_layout: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """A K tile's bytes `[BLOCK_N, HEAD_DIM]` (row order) as fp16 K^T `[HEAD_DIM, BLOCK_N]` in the dot's
    permuted dimension order (the module's docstring), the B operand."""
    x = raw.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    x = gl.reshape(x, [BLOCK_N, 4, HEAD_DIM // 16, 2, 2])  # byte b0 + 2 b1 + 4 s + (HEAD_DIM / 4) t
    x = gl.permute(x, [2, 3, 1, 4, 0])  # [s, b1, t, b0, key]: dimension b0 + 2 t + 8 b1 + 16 s
    return gl.convert_layout(gl.reshape(x, [HEAD_DIM, BLOCK_N]), b_layout, assert_trivial=True)


@gluon.jit
def _v_operand(raw, b_layout: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """A V tile's bytes `[BLOCK_N, HEAD_DIM]` as fp16 V `[BLOCK_N, HEAD_DIM]` in O's permuted column order
    (column 8 j + g is byte (HEAD_DIM / 8) g + j), the B operand."""
    x = raw.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    x = gl.permute(gl.reshape(x, [BLOCK_N, 8, HEAD_DIM // 8]), [0, 2, 1])  # [key, j, g]
    return gl.convert_layout(gl.reshape(x, [BLOCK_N, HEAD_DIM]), b_layout, assert_trivial=True)


@gluon.jit(do_not_specialize=["num_seqs", "num_splits"])
def _fp8_decode_kernel(
    q_ptr, kv_ptr, out_ptr, part_o_ptr, part_ml_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    seq_order_ptr, qk_scale, v_scale, num_seqs, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kv, stride_kb, stride_kt, stride_kh, stride_bt,
    G: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
    K_RAW: gl.constexpr, V_RAW: gl.constexpr, Q_RAW: gl.constexpr, O_LAYOUT: gl.constexpr, SPLIT_KV: gl.constexpr,
    ORDERED: gl.constexpr, USE_PDL: gl.constexpr,
):  # fmt: skip
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    J: gl.constexpr = HEAD_DIM // 8

    pdl_start(USE_PDL)
    kv_head = gl.program_id(0)
    seq, split = decode_program(seq_order_ptr, num_splits, SPLIT_KV, ORDERED)
    q_start = gl.load(query_start_loc_ptr + seq)
    q_len = gl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_len != 1:  # no new token (a padding row), or a prefill the other launch runs
        return
    seq_len = gl.load(seq_lens_ptr + seq)
    n_tiles = gl.cdiv(seq_len, BLOCK_N)
    if SPLIT_KV:
        per_split = gl.cdiv(n_tiles, num_splits)
        lo = gl.minimum(split * per_split, n_tiles)
        hi = gl.minimum(lo + per_split, n_tiles)
    else:
        lo = 0
        hi = n_tiles

    # Q [16, HEAD_DIM], rows past G padding (zeros), loaded in runs of HEAD_DIM / 4 (`q_raw_layout`), then put
    # in the dot's permuted dimension order: column 16b + 8c + 2a + d of the operand is Q's a (HEAD_DIM / 4) +
    # 4b + 2c + d, the order K's bytes are relabelled in (`_k_operand`).
    qm = gl.arange(0, 16, layout=gl.SliceLayout(1, Q_RAW))
    qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, Q_RAW))
    q_rows = q_start.to(gl.int64) * stride_qt + (kv_head * G + qm).to(gl.int64) * stride_qh
    q = gl.load(q_ptr + q_rows[:, None] + qd[None, :], mask=(qm < G)[:, None], other=0.0).to(gl.float16)
    q = gl.permute(gl.reshape(q, [16, 4, HEAD_DIM // 16, 2, 2]), [0, 2, 3, 1, 4])
    q = gl.convert_layout(gl.reshape(q, [16, HEAD_DIM]), a_layout, assert_trivial=True)

    bt_row = block_tables_ptr + seq.to(gl.int64) * stride_bt
    kv_head_off = kv_head.to(gl.int64) * stride_kh
    k_keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, K_RAW))
    k_bytes = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, K_RAW))
    v_keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, V_RAW))
    v_bytes = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, V_RAW))
    s_keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))

    acc = gl.zeros([16, HEAD_DIM], gl.float32, mma)
    l_i = gl.zeros([16], gl.float32, gl.SliceLayout(1, mma))
    m_i = gl.full([16], _NEG_BIG, gl.float32, gl.SliceLayout(1, mma))
    for tile in range(lo, hi):
        key0 = tile * BLOCK_N
        # Both tiles' loads are asked for before either is used.
        k_off, k_ok = _key_rows(bt_row, key0 + k_keys, seq_len, kv_head_off, stride_kb, stride_kt, BLOCK_SIZE)
        v_off, v_ok = _key_rows(bt_row, key0 + v_keys, seq_len, kv_head_off, stride_kb, stride_kt, BLOCK_SIZE)
        k = gl.load(kv_ptr + k_off[:, None] + k_bytes[None, :], mask=k_ok[:, None], other=0)
        v = gl.load(kv_ptr + stride_kv + v_off[:, None] + v_bytes[None, :], mask=v_ok[:, None], other=0)
        s = mma_v2(q, _k_operand(k, b_layout, BLOCK_N, HEAD_DIM), gl.zeros([16, BLOCK_N], gl.float32, mma))
        s = gl.where((key0 + s_keys < seq_len)[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        p16 = gl.convert_layout(p.to(gl.float16), a_layout, assert_trivial=True)
        acc = mma_v2(p16, _v_operand(v, b_layout, BLOCK_N, HEAD_DIM), acc * alpha[:, None])
        m_i = m_new
    acc = acc * v_scale  # sum_j p_j (v_j * v_scale), once a row

    # O's permuted columns back in place (column n of the accumulator is O's J (n % 8) + n // 8), as a reordering
    # of each thread's registers into runs of 2 J columns (`o_layout`).
    acc = gl.reshape(gl.permute(gl.reshape(acc, [16, J, 8]), [0, 2, 1]), [16, HEAD_DIM])
    acc = gl.convert_layout(acc, O_LAYOUT, assert_trivial=True)
    l_i = gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))
    m_i = gl.convert_layout(m_i, gl.SliceLayout(1, O_LAYOUT))
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, O_LAYOUT))
    out_col = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_LAYOUT))
    row_ok = rows < G
    head = kv_head * G + rows
    if SPLIT_KV:
        # kernels/attention.py's partials at BLOCK_Q = 1: [num_splits, num_seqs, 1, Hq, D] and [2, ...].
        hq = gl.num_programs(0) * G
        part_row = ((split * num_seqs + seq) * hq + head).to(gl.int64)
        o_ptrs = part_o_ptr + part_row[:, None] * HEAD_DIM + out_col[None, :]
        gl.store(o_ptrs, acc, mask=row_ok[:, None])
        ml_stride = num_splits * num_seqs * hq
        gl.store(part_ml_ptr + part_row, m_i, mask=row_ok)
        gl.store(part_ml_ptr + ml_stride + part_row, l_i, mask=row_ok)
    else:
        out = acc / gl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_rows = q_start.to(gl.int64) * stride_ot + head.to(gl.int64) * stride_oh
        o_ptrs = out_ptr + o_rows[:, None] + out_col[None, :]
        gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@functools.cache
def q_raw_layout(head_dim: int) -> gl.DistributedLinearLayout:
    """The layout Q `[16 rows, head_dim]` is loaded in: a thread's head_dim / 4 consecutive columns (the lane's t
    choosing which quarter) of rows g and g + 8. Relabelled (the kernel's Q block) it is the A operand's layout."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << i] for i in range((head_dim // 4).bit_length() - 1)] + [[8, 0]],
        lane_bases=[[0, head_dim // 4], [0, head_dim // 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[],
        block_bases=[],
        shape=[16, head_dim],
    )


@functools.cache
def o_layout(head_dim: int) -> gl.DistributedLinearLayout:
    """The layout O `[16 rows, head_dim]` is stored in: the accumulator's registers reordered, so that a thread
    holds 2 head_dim / 8 consecutive columns (from 2t head_dim / 8) of rows g and g + 8."""
    j = head_dim // 8
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << i] for i in range(j.bit_length() - 1)] + [[0, j], [8, 0]],
        lane_bases=[[0, 2 * j], [0, 4 * j], [1, 0], [2, 0], [4, 0]],
        warp_bases=[],
        block_bases=[],
        shape=[16, head_dim],
    )


@functools.cache
def raw_layouts(head_dim: int, block_n: int) -> tuple[gl.DistributedLinearLayout, gl.DistributedLinearLayout]:
    """The layouts the K and V tiles `[block_n keys, head_dim bytes]` are loaded in (one warp): K, a thread's
    head_dim / 4 bytes of key g (and g + 8, ...) in registers, the lane's t choosing the run; V, head_dim / 8
    bytes of keys 2t, 2t + 1, 2t + 8, 2t + 9 (and + 16, ...), the lane's g choosing the run. Relabelled
    (`_k_operand`, `_v_operand`) they are the dot operands' layouts."""
    key_regs = [[8 << i, 0] for i in range((block_n // 8).bit_length() - 1)]
    k_raw = gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << i] for i in range((head_dim // 4).bit_length() - 1)] + key_regs,
        lane_bases=[[0, head_dim // 4], [0, head_dim // 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[],
        block_bases=[],
        shape=[block_n, head_dim],
    )
    j = head_dim // 8
    v_raw = gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << i] for i in range(j.bit_length() - 1)] + [[1, 0]] + key_regs,
        lane_bases=[[2, 0], [4, 0], [0, j], [0, 2 * j], [0, 4 * j]],
        warp_bases=[],
        block_bases=[],
        shape=[block_n, head_dim],
    )
    return k_raw, v_raw


def takes(q: torch.Tensor, kv_layer: torch.Tensor, window: int | None, block_q: int, num_seqs: int) -> bool:
    """Whether a decode launch is this kernel's (`usable` adds the device): switched on, an FP8 cache, one new
    token a sequence, at least `MIN_PROGRAMS` programs (`num_seqs` x KV heads), no window, bf16 or fp16 queries,
    16 to 128 head dimensions, at most 16 query heads a KV head (any block size: each key's block is looked
    up)."""
    if not (FP8_DECODE_MMA and kv_layer.dtype == torch.float8_e4m3fn):
        return False
    num_kv_heads, head_dim = kv_layer.shape[3:]
    return (
        window is None
        and block_q == 1
        and num_seqs * num_kv_heads >= MIN_PROGRAMS
        and q.dtype
        in (torch.bfloat16, torch.float16)  # float32 queries keep the Triton kernel's float32 dots
        and head_dim in (16, 32, 64, 128)
        and q.shape[1] // num_kv_heads <= 16
    )


def usable(q: torch.Tensor, kv_layer: torch.Tensor, window: int | None, block_q: int, num_seqs: int) -> bool:
    """`takes` on a GPU that converts E4M3 natively (compute capability 8.9 or later), outside Triton's
    interpreter (which cannot run Gluon)."""
    return (
        takes(q, kv_layer, window, block_q, num_seqs)
        and q.is_cuda
        and not INTERPRET
        and _converts_fp8(q.device.index if q.device.index is not None else -1)
    )


@functools.cache
def _converts_fp8(device_index: int) -> bool:
    """Whether the device converts E4M3 natively (compute capability 8.9 or later), once a process and device."""
    return torch.cuda.get_device_capability(device_index if device_index >= 0 else None) >= (8, 9)


def splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, q: torch.Tensor, sms: int | None = None
) -> int:
    """KV splits, as kernels/attention_configs.py chooses them, for one-warp programs (`sms`: the device's)."""
    slots = PROGRAMS_PER_SM * (sms or num_sms(q.device))
    return splits_for_programs(num_seqs * num_kv_heads, slots, max(1, min(64, max_seq_len // (4 * BLOCK_N))))


def fp8_decode(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_order: torch.Tensor | None,
    qk_scale: float,
    v_scale: float,
    ranks: int,
    num_splits: int,
    part_o: torch.Tensor,
    part_ml: torch.Tensor,
) -> None:
    """The decode launch over an FP8 cache (`takes`): kernels/attention.py's launcher calls it in place of its own
    decode launch, with its arguments (`qk_scale` already in base 2 with k_scale in it), and reduces the
    partials itself when `num_splits` > 1."""
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    k_raw, v_raw = raw_layouts(head_dim, BLOCK_N)
    _fp8_decode_kernel[(num_kv_heads, ranks * num_splits)](
        q, kv_layer.view(torch.uint8), out, part_o, part_ml, block_tables, seq_lens, query_start_loc,
        seq_lens if seq_order is None else seq_order, qk_scale, v_scale, seq_lens.shape[0], num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv_layer.stride(0), kv_layer.stride(1),
        kv_layer.stride(2), kv_layer.stride(3), block_tables.stride(0),
        G=q.shape[1] // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
        K_RAW=k_raw, V_RAW=v_raw, Q_RAW=q_raw_layout(head_dim), O_LAYOUT=o_layout(head_dim), SPLIT_KV=num_splits > 1,
        ORDERED=seq_order is not None, num_warps=1, **pdl_options(q),
        **({"maxnreg": SPLIT_MAXNREG} if num_splits > 1 else {}),
    )  # fmt: skip
