"""The sampling and bitmask kernels compile for the H200 (sm_90) here, without a GPU: Triton's interpreter, which the
kernel tests use, accepts code that the compiler rejects (a constexpr assigned in a loop, say)."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tinypaged.kernels.bitmask import _apply_bitmask_kernel
from tinypaged.kernels.sampling import _sample_kernel


def test_sampling_kernel_compiles_for_hopper() -> None:
    signature = {
        "logits_ptr": "*bf16",
        "stride": "i64",
        "vocab": "i32",
        "temp_ptr": "*fp32",
        "top_k_ptr": "*i32",
        "top_p_ptr": "*fp32",
        "min_p_ptr": "*fp32",
        "keys_ptr": "*i64",
        "out_ptr": "*i64",
        "MAX_ROUNDS": "constexpr",
        "BLOCK": "constexpr",
    }
    src = ASTSource(fn=_sample_kernel, signature=signature, constexprs={"MAX_ROUNDS": 256, "BLOCK": 4096})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert "cubin" in kernel.asm


def test_bitmask_kernel_compiles_for_hopper() -> None:
    signature = {
        "logits_ptr": "*fp32",
        "stride": "i64",
        "bitmask_ptr": "*i32",
        "mask_stride": "i64",
        "rows_ptr": "*i32",
        "vocab": "i32",
        "BLOCK": "constexpr",
    }
    src = ASTSource(fn=_apply_bitmask_kernel, signature=signature, constexprs={"BLOCK": 4096})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "cubin" in kernel.asm


def test_rotary_write_kv_kernel_compiles_for_hopper() -> None:
    from tinypaged.kernels.rotary import _rotary_write_kv_kernel

    pointers = {
        "pos_ptr": "*i32", "slot_ptr": "*i32", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
        "cache_ptr": "*fp32", "q_out_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
    }  # fmt: skip
    ints = [
        "n_q_heads", "n_k_heads", "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
        "stride_qot", "stride_qoh", "stride_cb", "stride_ct", "stride_ch", "stride_c",
    ]  # fmt: skip
    constexprs = {"BLOCK_SIZE": 16, "HALF": 64, "BLOCK_HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 8}
    signature = pointers | dict.fromkeys(ints, "i64") | dict.fromkeys(constexprs, "constexpr")
    src = ASTSource(fn=_rotary_write_kv_kernel, signature=signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "cubin" in kernel.asm


def test_gemv_kernel_compiles_for_hopper() -> None:
    from tinypaged.kernels.gemv import _gemv_kernel, default_config

    block_n, block_k, warps = default_config(1, 4096, 14336)
    constexprs = {"HAS_BIAS": False, "BLOCK_M": 1, "BLOCK_N": block_n, "BLOCK_K": block_k}
    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16"}
    signature |= dict.fromkeys(["M", "N", "K", "stride_x", "stride_w", "stride_y"], "i32")
    signature |= dict.fromkeys(constexprs, "constexpr")
    # As a launch specializes them: pointers, sizes and strides that are multiples of 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name != "M" and i < 10}
    src = ASTSource(fn=_gemv_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert "cubin" in kernel.asm
    # The weight streams in 16-byte loads (scalar loads would leave the kernel far below the bandwidth).
    assert kernel.asm["ptx"].count("ld.global.v4") >= block_k * block_n * 2 // 16 // (32 * warps)
