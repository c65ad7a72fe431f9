"""KV cache writes: new keys/values into their slots (quantized into an FP8 cache), and copy-on-write block copies
across all layers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import INTERPRET, quantize_e4m3
from .pdl import pdl_options, pdl_start


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    n_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Copy token t's keys and values `[Hkv, D]` into slot `slot_mapping[t]`, unless that slot is negative; an
    FP8 cache gets them quantized with `k_scale` and `v_scale`."""
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    ok = (heads[:, None] < n_heads) & (cols[None, :] < HEAD_DIM) & (slot >= 0)
    slot_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
    dst = slot_off + heads[:, None] * stride_ch + cols[None, :]
    k = tl.load(key_ptr + t * stride_kt + heads[:, None] * stride_kh + cols[None, :], mask=ok)
    v = tl.load(value_ptr + t * stride_vt + heads[:, None] * stride_vh + cols[None, :], mask=ok)
    if FP8:
        k = quantize_e4m3(k.to(tl.float32), k_scale, INTERPRET)
        v = quantize_e4m3(v.to(tl.float32), v_scale, INTERPRET)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value `[T, Hkv, D]` into `kv_layer` at `slot_mapping` (semantics: `ops.ref_write_kv`)."""
    num_tokens, n_heads, head_dim = key.shape
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_layer.stride(-1) == 1
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_layer[0], kv_layer[1]
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        n_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=kv_layer.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(n_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=kv_layer.dtype == torch.float8_e4m3fn,
        INTERPRET=INTERPRET,
        num_warps=4,
        **pdl_options(key),
    )


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,
    mapping_ptr,
    stride_layer,
    stride_kv,
    stride_block,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Copy one chunk of block `mapping[i, 0]` to block `mapping[i, 1]` in one (layer, key-or-value) plane."""
    pair = tl.program_id(0).to(tl.int64)
    plane = tl.program_id(1)
    src = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    base = cache_ptr + (plane // 2).to(tl.int64) * stride_layer + (plane % 2) * stride_kv
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    ok = offs < BLOCK_NUMEL
    x = tl.load(base + src * stride_block + offs, mask=ok)
    tl.store(base + dst * stride_block + offs, x, mask=ok)


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks `src -> dst` (rows of `[N, 2]`) in every layer, keys and values, in one launch.

    Semantics: `ops.ref_copy_blocks`, for mappings whose destinations are not also sources (copy-on-write).
    """
    num_layers, _, _, block_size, n_heads, head_dim = kv_cache.shape
    block_numel = block_size * n_heads * head_dim
    assert kv_cache[0, 0, 0].is_contiguous(), "each block must be contiguous"
    mapping = block_mapping.contiguous()
    n_pairs = mapping.shape[0]
    if n_pairs == 0:
        return
    chunk = min(4096, triton.next_power_of_2(block_numel))
    grid = (n_pairs, 2 * num_layers, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        kv_cache.view(torch.uint8)
        if kv_cache.dtype == torch.float8_e4m3fn
        else kv_cache,  # bytes, as they are
        mapping,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        BLOCK_NUMEL=block_numel,
        CHUNK=chunk,
        num_warps=4,
    )
