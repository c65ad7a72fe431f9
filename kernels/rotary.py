"""Neox-style rotary embedding of q and k: one program per token, every head of both in one pass; and the same
fused with the KV cache write (the rotated keys and the values go straight into their slots, quantized there
when the cache is FP8), optionally after a per-head RMSNorm of q and k (Qwen3's and Gemma 3's q/k norms: a
head's row is in registers already, so the norm costs no launch and no trip through memory)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import INTERPRET, quantize_e4m3
from .pdl import pdl_options, pdl_start


@triton.jit
def _rotate_heads(
    x_ptr,
    o_ptr,
    t,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    n_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    store,
    scale,
    FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
    norm_ptr=None,
    eps=0.0,
    NORM: tl.constexpr = False,
):
    """Rotate the first and second halves of every head of token t by the angles whose cos/sin are given, into
    row t of o_ptr (nothing is read or written unless `store`); with FP8, quantized with `scale` after the
    rounding to x's dtype (as the rotary embedding, then the cache write, would store them). NORM: each head
    first RMS-normalised over its 2 * HALF dims, times the weight at norm_ptr, in float32 and rounded to x's
    dtype, as `ops.rms_norm` stores it for the rotation to read."""
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    ok = (heads[:, None] < n_heads) & (cols[None, :] < HALF) & store
    x_lo = x_ptr + t * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(x_lo, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_lo + HALF, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x1 * x1 + x2 * x2, 1) / (2 * HALF) + eps)[:, None]
        c_ok = cols[None, :] < HALF
        w1 = tl.load(norm_ptr + cols[None, :], mask=c_ok, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + HALF + cols[None, :], mask=c_ok, other=0.0).to(tl.float32)
        x1 = (x1 * rstd * w1).to(x_ptr.dtype.element_ty).to(tl.float32)
        x2 = (x2 * rstd * w2).to(x_ptr.dtype.element_ty).to(tl.float32)
    o_lo = o_ptr + t * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    lo = x1 * cos - x2 * sin
    hi = x2 * cos + x1 * sin
    if FP8:
        lo = quantize_e4m3(lo.to(x_ptr.dtype.element_ty).to(tl.float32), scale, INTERPRET)
        hi = quantize_e4m3(hi.to(x_ptr.dtype.element_ty).to(tl.float32), scale, INTERPRET)
    dtype = o_ptr.dtype.element_ty
    tl.store(o_lo, lo.to(dtype), mask=ok)
    tl.store(o_lo + HALF, hi.to(dtype), mask=ok)


@triton.jit
def _cos_sin(pos_ptr, cache_ptr, t, stride_c, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The cos and sin rows `[1, BLOCK_HALF]` of token t's position."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    c_ok = cols < HALF
    cos = tl.load(cache_ptr + pos * stride_c + cols, mask=c_ok, other=0.0)[None, :]
    sin = tl.load(cache_ptr + pos * stride_c + HALF + cols, mask=c_ok, other=0.0)[None, :]
    return cos, sin


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_out_ptr,
    k_out_ptr,
    n_q_heads,
    n_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_c,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Rotary embedding of all q and k heads of one token."""
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, cache_ptr, t, stride_c, HALF, BLOCK_HALF)
    _rotate_heads(
        q_ptr,
        q_out_ptr,
        t,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        n_q_heads,
        cos,
        sin,
        HALF,
        BLOCK_HQ,
        BLOCK_HALF,
        True,
        1.0,
        False,
        False,
    )
    _rotate_heads(
        k_ptr,
        k_out_ptr,
        t,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        n_k_heads,
        cos,
        sin,
        HALF,
        BLOCK_HK,
        BLOCK_HALF,
        True,
        1.0,
        False,
        False,
    )


def _launch_args(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> dict[str, int]:
    """What both launches check, and their tile sizes and warps: q `[T, Hq, D]`, k `[T, Hkv, D]`."""
    head_dim = q.shape[2]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[-1] == head_dim
    half = head_dim // 2
    block_hq = triton.next_power_of_2(q.shape[1])
    return {
        "HALF": half,
        "BLOCK_HALF": triton.next_power_of_2(half),
        "BLOCK_HQ": block_hq,
        "BLOCK_HK": triton.next_power_of_2(k.shape[1]),
        "num_warps": min(8, max(1, block_hq * triton.next_power_of_2(half) // 512)),
    }


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[T, Hq, D]` and k `[T, Hkv, D]` into new tensors (semantics: `ops.ref_rotary_embedding`)."""
    args = _launch_args(q, k, cos_sin_cache)
    num_tokens, n_q_heads, n_k_heads = q.shape[0], q.shape[1], k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions,
            q,
            k,
            cos_sin_cache,
            q_out,
            k_out,
            n_q_heads,
            n_k_heads,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_out.stride(0),
            k_out.stride(1),
            cos_sin_cache.stride(0),
            **args,
            **pdl_options(q),
        )
    return q_out, k_out


@triton.jit
def _rotary_write_kv_kernel(
    pos_ptr,
    slot_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cache_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale,
    v_scale,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    n_q_heads,
    n_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_c,
    BLOCK_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,
    NORM: tl.constexpr,
):
    """One token: its q heads rotated into q_out; its k heads rotated and its v heads copied into its cache slot
    (none when the slot is negative), quantized with `k_scale` and `v_scale` into an FP8 cache. NORM: q's and
    k's heads RMS-normalised first (weights at q_norm_ptr and k_norm_ptr, `eps`)."""
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, cache_ptr, t, stride_c, HALF, BLOCK_HALF)
    _rotate_heads(
        q_ptr, q_out_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, n_q_heads, cos, sin, HALF, BLOCK_HQ,
        BLOCK_HALF, True, 1.0, False, False, q_norm_ptr, eps, NORM,
    )  # fmt: skip
    # The slot as row 0 of the cache, its heads strided: the rotated keys land where the write would put them.
    in_cache = slot >= 0
    slot_off = tl.where(in_cache, (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct, 0)
    _rotate_heads(
        k_ptr, k_cache_ptr + slot_off, t, stride_kt, stride_kh, 0, stride_ch, n_k_heads, cos, sin, HALF, BLOCK_HK,
        BLOCK_HALF, in_cache, k_scale, FP8, INTERPRET, k_norm_ptr, eps, NORM,
    )  # fmt: skip
    heads = tl.arange(0, BLOCK_HK)
    dims = tl.arange(0, 2 * BLOCK_HALF)
    ok = (heads[:, None] < n_k_heads) & (dims[None, :] < 2 * HALF) & in_cache
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=ok)
    if FP8:
        v = quantize_e4m3(v.to(tl.float32), v_scale, INTERPRET)
    dst = v_cache_ptr + slot_off + heads[:, None] * stride_ch + dims[None, :]
    tl.store(dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def rotary_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """q rotated (a new tensor); k rotated and v written into `kv_layer` at `slot_mapping`, in one launch
    (semantics: `ops.ref_rotary_embedding`, then `ops.ref_write_kv` of the rotated k). `qk_norm`: (q's norm
    weight, k's, eps `[D]`): each head of q and k RMS-normalised first (`ops.ref_rms_norm` of its rows)."""
    args = _launch_args(q, k, cos_sin_cache)
    assert v.stride(-1) == 1 and kv_layer.stride(-1) == 1
    num_tokens, n_q_heads, n_k_heads = q.shape[0], q.shape[1], k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens:
        k_cache, v_cache = kv_layer[0], kv_layer[1]
        q_norm, k_norm, eps = qk_norm if qk_norm is not None else (q, q, 0.0)
        assert qk_norm is None or q_norm.shape == k_norm.shape == (q.shape[2],)
        _rotary_write_kv_kernel[(num_tokens,)](
            positions,
            slot_mapping,
            q,
            k,
            v,
            cos_sin_cache,
            q_out,
            k_cache,
            v_cache,
            float(k_scale),
            float(v_scale),
            q_norm,
            k_norm,
            float(eps),
            n_q_heads,
            n_k_heads,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            cos_sin_cache.stride(0),
            BLOCK_SIZE=kv_layer.shape[2],
            FP8=kv_layer.dtype == torch.float8_e4m3fn,
            INTERPRET=INTERPRET,
            NORM=qk_norm is not None,
            **args,
            **pdl_options(q),
        )
    return q_out
