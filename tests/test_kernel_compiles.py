"""Kernels compile for the H200 (sm_90) here, without a GPU: Triton's interpreter, which the kernel tests use, accepts
code that the compiler rejects (a constexpr assigned in a loop, say), and never runs the GPU-only paths (the waits of
programmatic dependent launch)."""

from __future__ import annotations

import importlib
import re
from typing import Any

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tinypaged.kernels.bitmask import _apply_bitmask_kernel
from tinypaged.kernels.pdl import pdl_options
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


def compile_bitmask_kernel() -> Any:
    """The token-bitmask kernel compiled for sm_90 (no GPU needed); tests/test_compile_cache.py compiles it too."""
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
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def test_bitmask_kernel_compiles_for_hopper() -> None:
    assert "cubin" in compile_bitmask_kernel().asm


@pytest.mark.parametrize("norm", [False, True])
def test_rotary_write_kv_kernel_compiles_for_hopper(norm: bool) -> None:
    """The fused rotary + KV write, with and without the per-head q/k norms (Gemma 3's head_dim 256)."""
    from tinypaged.kernels.rotary import _rotary_write_kv_kernel

    pointers = {
        "pos_ptr": "*i32", "slot_ptr": "*i32", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
        "cache_ptr": "*fp32", "q_out_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
        "q_norm_ptr": "*fp32", "k_norm_ptr": "*fp32",
    }  # fmt: skip
    ints = [
        "n_q_heads", "n_k_heads", "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
        "stride_qot", "stride_qoh", "stride_cb", "stride_ct", "stride_ch", "stride_c",
    ]  # fmt: skip
    constexprs = {
        "BLOCK_SIZE": 16,
        "HALF": 128 if norm else 64,
        "BLOCK_HALF": 128 if norm else 64,
        "BLOCK_HQ": 8 if norm else 32,
        "BLOCK_HK": 4 if norm else 8,
        "FP8": False,
        "INTERPRET": False,
        "USE_PDL": True,
        "NORM": norm,
    }
    scales = {"k_scale": "fp32", "v_scale": "fp32", "eps": "fp32"}
    signature = pointers | scales | dict.fromkeys(ints, "i64") | dict.fromkeys(constexprs, "constexpr")
    src = ASTSource(fn=_rotary_write_kv_kernel, signature=signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "cubin" in kernel.asm
    assert "griddepcontrol.wait" in kernel.asm["ptx"]
    assert ("sqrt" in kernel.asm["ptx"]) == norm  # the norm's square root (rsqrt or sqrt) only with NORM


def test_gemv_kernel_compiles_for_hopper() -> None:
    from tinypaged.kernels.gemv import _gemv_kernel, default_config

    block_n, block_k, warps = default_config(1, 4096, 14336)
    constexprs = {"HAS_BIAS": False, "BLOCK_M": 1, "BLOCK_N": block_n, "BLOCK_K": block_k}
    constexprs["USE_PDL"] = True
    signature = dict.fromkeys(["x_ptr", "w_ptr", "b_ptr", "y_ptr"], "*bf16")
    signature |= dict.fromkeys(["M", "N", "K", "stride_x", "stride_w", "stride_y"], "i32")
    signature |= dict.fromkeys(constexprs, "constexpr")
    # As a launch specializes them: pointers, sizes and strides that are multiples of 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name != "M" and i < 10}
    src = ASTSource(fn=_gemv_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert "cubin" in kernel.asm
    assert "griddepcontrol.wait" in kernel.asm["ptx"]
    # The weight streams in 16-byte loads (scalar loads would leave the kernel far below the bandwidth).
    assert kernel.asm["ptx"].count("ld.global.v4") >= block_k * block_n * 2 // 16 // (32 * warps)


# The kernels a model step launches with programmatic dependent launch (kernels/pdl.py), with constexprs as a
# decode step of the 8B shape sets them.
_PDL_KERNELS = {
    "gemv._gemv_kernel": {"HAS_BIAS": False, "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 1024},
    "norm._rms_norm_kernel": {"HAS_RESIDUAL": True, "FP8_OUT": False, "BLOCK": 4096, "INTERPRET": False},
    "activation._silu_and_mul_kernel": {"BLOCK": 1024, "GELU": False},
    "cache._write_kv_kernel": {
        "BLOCK_SIZE": 16, "HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128, "FP8": False, "INTERPRET": False,
    },
    "rotary._rotary_kernel": {"HALF": 64, "BLOCK_HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 8},
    "rotary._rotary_write_kv_kernel": {
        "BLOCK_SIZE": 16, "HALF": 64, "BLOCK_HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 8, "FP8": False,
        "INTERPRET": False, "NORM": False,
    },
    "attention._paged_attn_kernel": {
        "G": 4, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_M": 16, "BLOCK_Q": 1, "BLOCK_N": 16, "DECODE": True,
        "SHORT_Q": 1, "SPLIT_KV": True, "ORDERED": True, "DOT_PREC": "tf32", "KV_FP8": False,
        "WINDOWED": False,
    },
    "attention._reduce_kernel": {"HEAD_DIM": 128, "SPLITS_POW2": 4, "BLOCK_Q": 1},
}  # fmt: skip


def _arg_type(name: str) -> str:
    if name.endswith("_ptr"):
        if any(s in name for s in ("loc", "lens", "order", "tables", "slot", "pos")):
            return "*i32"
        return "*fp32" if name.startswith("part_") or name == "cache_ptr" else "*bf16"
    return "fp32" if name in ("eps", "qk_scale", "k_scale", "v_scale") else "i32"


@pytest.mark.parametrize("name", sorted(_PDL_KERNELS))
def test_pdl_kernels_wait_before_touching_memory(name: str) -> None:
    """With USE_PDL a kernel may start while the previous one still runs: its first global load or store must
    come after `griddepcontrol.wait`. Without USE_PDL neither PDL instruction is in the kernel."""
    module, fn_name = name.split(".")
    fn = getattr(importlib.import_module(f"tinypaged.kernels.{module}"), fn_name)
    for use_pdl in (False, True):
        constexprs = _PDL_KERNELS[name] | {"USE_PDL": use_pdl}
        signature = {a: "constexpr" if a in constexprs else _arg_type(a) for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        assert ("griddepcontrol.launch_dependents" in ptx) == use_pdl
        if not use_pdl:
            assert "griddepcontrol.wait" not in ptx
            continue
        wait = ptx.index("griddepcontrol.wait")
        first_access = min(ptx.find(op) % len(ptx) for op in ("ld.global", "st.global"))
        assert wait < first_access, f"{name} touches memory before griddepcontrol.wait"


# The FP8 kernels as a decode step of the 8B shape launches them: (pointer types, constexprs).
def _quantize(swiglu: bool, one_tile: bool, block: int) -> tuple[dict[str, str], dict[str, Any]]:
    pointers = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "static_ptr": "*fp32"}
    return pointers, {"SWIGLU": swiglu, "STATIC": False, "ONE_TILE": one_tile, "BLOCK": block}


_FP8_KERNELS = {
    "fp8._quantize_kernel": _quantize(False, True, 4096),
    "fp8._quantize_kernel two passes": _quantize(False, False, 4096),
    "fp8._quantize_kernel swiglu": _quantize(True, True, 16384),
    "fp8._quantize_kernel swiglu two passes": _quantize(True, False, 4096),
    "fp8._swiglu_tiles_kernel": ({"x_ptr": "*bf16", "h_ptr": "*bf16", "amax_ptr": "*fp32"}, {"BLOCK": 1024}),
    "fp8._quantize_tiles_kernel": (
        {"h_ptr": "*bf16", "amax_ptr": "*fp32", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
        {"TILES": 16, "BLOCK": 1024},
    ),
    "norm._rms_norm_kernel": (
        {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp8e4nv", "res_out_ptr": "*bf16",
         "scale_ptr": "*fp32"},
        {"HAS_RESIDUAL": True, "FP8_OUT": True, "BLOCK": 4096},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_FP8_KERNELS))
def test_fp8_kernels_compile_for_hopper(name: str) -> None:
    """The FP8 kernels compile for sm_90 with programmatic dependent launch (the wait before any memory access),
    the quantizers with the GPU's own E4M3 conversion (round to nearest even, saturating) after an IEEE division
    (Triton's `/` is approximate there)."""
    module, fn_name = name.split()[0].split(".")
    fn = getattr(importlib.import_module(f"tinypaged.kernels.{module}"), fn_name)
    pointers, constexprs = _FP8_KERNELS[name]
    constexprs = (
        constexprs | {"USE_PDL": True} | ({"INTERPRET": False} if "INTERPRET" in fn.arg_names else {})
    )
    signature = {
        a: "constexpr" if a in constexprs else pointers.get(a, "fp32" if a == "eps" else "i32")
        for a in fn.arg_names
    }
    # As a launch specializes them: pointers, sizes and strides that are multiples of 16 (the row count aside).
    aligned = [i for i, a in enumerate(fn.arg_names) if signature[a] != "constexpr" and a not in ("M", "eps")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    assert wait < min(ptx.find(op) % len(ptx) for op in ("ld.global", "st.global"))
    if fn_name == "_swiglu_tiles_kernel":
        assert "cvt.rn.bf16" in ptx
    else:
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx


def test_pdl_off_on_the_cpu() -> None:
    assert pdl_options(torch.zeros(1)) == {"USE_PDL": False, "launch_pdl": False}


# The FP8 KV cache's kernels (kv_cache_dtype="fp8"), as a step of the 8B shape launches them: the cache E4M3.
_FP8_KV_KERNELS = {
    "cache._write_kv_kernel": _PDL_KERNELS["cache._write_kv_kernel"] | {"FP8": True},
    "rotary._rotary_write_kv_kernel": _PDL_KERNELS["rotary._rotary_write_kv_kernel"] | {"FP8": True},
    "attention._paged_attn_kernel": _PDL_KERNELS["attention._paged_attn_kernel"] | {"KV_FP8": True},
    "attention._paged_attn_kernel:prefill": _PDL_KERNELS["attention._paged_attn_kernel"]
    | {"KV_FP8": True, "DECODE": False, "SPLIT_KV": False, "ORDERED": False, "BLOCK_M": 128, "BLOCK_Q": 32},
}


@pytest.mark.parametrize("name", sorted(_FP8_KV_KERNELS))
def test_fp8_kv_kernels_compile_for_hopper(name: str) -> None:
    """With an E4M3 cache the writes quantize with IEEE division and the hardware's saturating conversion (the
    interpreter's emulation compiled out), and attention converts what it loads from E4M3."""
    module, fn_name = name.partition(":")[0].split(".")
    fn = getattr(importlib.import_module(f"tinypaged.kernels.{module}"), fn_name)
    constexprs = _FP8_KV_KERNELS[name] | {"USE_PDL": True}
    cache_args = {"k_cache_ptr", "v_cache_ptr", "kv_ptr"}
    signature = {
        a: "constexpr" if a in constexprs else "*fp8e4nv" if a in cache_args else _arg_type(a)
        for a in fn.arg_names
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    if module == "attention":
        assert "cvt.rn.bf16x2.e4m3x2" in ptx or "cvt.rn.f16x2.e4m3x2" in ptx
    else:
        assert "div.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx


@pytest.mark.parametrize("rows, split", [(1, False), (16, True), (64, False), (64, True)])
def test_fp8_matmul_runs_on_fp8_tensor_cores(rows: int, split: bool) -> None:
    """The FP8 matmul's default tile at few rows (computed transposed) and at 64, split along K or not, reaches
    sm_90's FP8 wgmma with its E4M3 operands as they are: under 64 rows on the instruction's M side Triton would
    convert both to fp16. A split launch counts its programs in with one acquire-release atomic a program."""
    from tinypaged.kernels.fp8_gemm import _fp8_gemm_kernel, default_config

    block_m, block_n, block_k, warps, stages, _ = default_config(rows, 4096 if split else 28672, 4096)
    constexprs = {"HAS_BIAS": False, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
    constexprs |= {"SWAP_AB": block_m < 64, "SPLIT": split, "SCALED": True, "USE_PDL": True}
    types = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "b_ptr": "*bf16"}
    types |= {"part_ptr": "*fp32", "count_ptr": "*i32"}
    signature = {
        a: "constexpr" if a in constexprs else types.get(a, "*bf16" if a == "y_ptr" else "i32")
        for a in _fp8_gemm_kernel.arg_names
    }
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, a in enumerate(_fp8_gemm_kernel.arg_names)
        if a not in constexprs and (signature[a].startswith("*") or a.startswith("stride") or a == "K")
    }
    src = ASTSource(fn=_fp8_gemm_kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    options = {"num_warps": warps, "num_stages": stages}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    assert "wgmma.mma_async" in ptx and "e4m3.e4m3" in ptx
    assert "cvt.rn.f16x2.e4m3x2" not in ptx
    assert ("atom.global.gpu.acq_rel.add" in ptx) == split


@pytest.mark.parametrize("rows", [2, 16])
def test_skinny_matmul_runs_on_bf16_wgmma(rows: int) -> None:
    """The unscaled kernel at a few bf16 rows (`skinny_matmul`, a verification's 5-16 rows): the transposed tile
    reaches sm_90's wgmma on bf16 operands, split along K as the layer's shape says, and loads no scales."""
    from tinypaged.kernels.fp8_gemm import _fp8_gemm_kernel, skinny_config

    block_m, block_n, block_k, warps, stages, k_split = skinny_config(rows, 4096, 4096)
    assert block_m == 16 and k_split
    constexprs = {"HAS_BIAS": False, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
    constexprs |= {"SWAP_AB": True, "SPLIT": True, "SCALED": False, "USE_PDL": True}
    types = {"xs_ptr": "*bf16", "ws_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
    signature = {
        a: "constexpr" if a in constexprs else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
        for a in _fp8_gemm_kernel.arg_names
    }
    src = ASTSource(fn=_fp8_gemm_kernel, signature=signature, constexprs=constexprs)
    options = {"num_warps": warps, "num_stages": stages}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    assert "wgmma.mma_async" in ptx and "bf16.bf16" in ptx
    assert "griddepcontrol.wait" in ptx


def _lowbit_compile(fn_name: str, constexprs: dict[str, Any], warps: int = 4) -> Any:
    from tinypaged.kernels import lowbit

    fn = getattr(lowbit, fn_name)
    types = {"w_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8", "part_ptr": "*fp32", "count_ptr": "*i32"}
    signature = {
        a: "constexpr" if a in constexprs else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
        for a in fn.arg_names
    }
    aligned = [i for i, a in enumerate(fn.arg_names) if signature[a] != "constexpr" and a != "M"]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


@pytest.mark.parametrize("bits", [4, 8])
def test_lowbit_kernels_compile_for_hopper(bits: int) -> None:
    """The INT4 / INT8 GEMV, tensor-core kernel (transposed tile and not, K split or not) and dequantize kernels
    compile for sm_90 with programmatic dependent launch; the GEMV reads its words in 16-byte loads (INT8's
    products in inline PTX, the activations in 16-byte loads too) and the tensor-core kernel runs bf16 wgmma
    (mma.sync with two warps), INT4 codes turned into bf16 by the inline PTX; a split launch counts its programs
    in with a release-acquire atomic."""
    base = {
        "GROUP": 128,
        "BITS": bits,
        "HAS_ZERO": bits == 4,
        "HAS_BIAS": False,
        "SPLIT": False,
        "BLOCK_K": 128,
        "ASM": bits == 4,
        "USE_PDL": True,
    }
    gemv = _lowbit_compile(  # ASM: INT8's products in the PTX chain (`gemv_ptx`); INT4's GEMV has none
        "_wint_kernel",
        base | {"BLOCK_M": 1, "BLOCK_N": 32, "DOT": False, "SWAP_AB": True, "IEEE": False, "ASM": True},
    )
    ptx = gemv.asm["ptx"]
    if bits == 8:  # a prmt a code, the activations 8 bytes a word (16-byte loads of two words' runs)
        words_a_thread = 32 * (128 // 4) // 128  # BLOCK_N rows x a step's words a row / the 128 threads
        assert ptx.count("prmt.b32") == words_a_thread * 4 and "ld.global.v2.b64" in ptx
    assert ptx.index("griddepcontrol.wait") < min(
        ptx.find(op) % len(ptx) for op in ("ld.global", "st.global")
    )
    assert ptx.count("ld.global.v4") >= 32 * 128 * bits // 8 // 16 // 128
    assert "atom.global" not in ptx
    split = _lowbit_compile(
        "_wint_kernel",
        base | {"BLOCK_M": 1, "BLOCK_N": 64, "DOT": False, "SWAP_AB": True, "IEEE": False, "SPLIT": True},
    )
    assert "atom.global.gpu.acq_rel.add" in split.asm["ptx"]
    wide = base | {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 512, "DOT": False, "SWAP_AB": True, "IEEE": False}
    _lowbit_compile("_wint_kernel", wide)  # a GEMV step over four whole groups
    for block_m, swap in ((16, True), (64, False)):
        gemm = _lowbit_compile(
            "_wint_kernel",
            base | {"BLOCK_M": block_m, "BLOCK_N": 64, "DOT": True, "SWAP_AB": swap, "IEEE": False},
        )
        assert "wgmma" in gemm.asm["ptx"]
        if bits == 4:  # the codes become bf16 pairs by the inline PTX
            assert "prmt.b32" in gemm.asm["ptx"] and "fma.rn.bf16x2" in gemm.asm["ptx"]
    # two warps (the default up to 16 rows): the tensor cores through mma.sync (no wgmma)
    gemm = _lowbit_compile(
        "_wint_kernel",
        base | {"BLOCK_M": 16, "BLOCK_N": 128, "DOT": True, "SWAP_AB": True, "IEEE": False, "SPLIT": True},
        2,
    )
    assert "mma.sync" in gemm.asm["ptx"] and "wgmma" not in gemm.asm["ptx"]
    _lowbit_compile(
        "_dequantize_kernel",
        {k: base[k] for k in ("GROUP", "BITS", "HAS_ZERO", "BLOCK_K", "USE_PDL")} | {"BLOCK_N": 32},
    )


@pytest.mark.parametrize("decode", [True, False])
def test_sliding_window_attention_compiles_for_hopper(decode: bool) -> None:
    """The windowed attention (Mistral's, Gemma 3's local layers) compiles for sm_90 in both modes: the
    interpreter accepts the tile remapping of its masked loop whatever the compiler would make of it."""
    from tinypaged.kernels.attention import _paged_attn_kernel

    constexprs = _PDL_KERNELS["attention._paged_attn_kernel"] | {"WINDOWED": True, "USE_PDL": True}
    if not decode:
        constexprs |= {"DECODE": False, "SPLIT_KV": False, "ORDERED": False, "BLOCK_M": 128, "BLOCK_Q": 32}
    signature = {a: "constexpr" if a in constexprs else _arg_type(a) for a in _paged_attn_kernel.arg_names}
    src = ASTSource(fn=_paged_attn_kernel, signature=signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "cubin" in kernel.asm


@pytest.mark.parametrize("decode", [True, False])
def test_attention_tiles_of_head_dim_256_fit_hopper(decode: bool) -> None:
    """Gemma 3's head_dim of 256 in bf16: the default tiles compile for sm_90 within its 227 KB of shared
    memory a block (a launch past it fails with "out of resources", which the interpreter never sees)."""
    from tinypaged.kernels.attention import _paged_attn_kernel
    from tinypaged.kernels.attention_configs import _default_configs

    cfg = _default_configs(True, 2, 256, 2)[0 if decode else 1]
    constexprs = _PDL_KERNELS["attention._paged_attn_kernel"] | {"HEAD_DIM": 256, "G": 2, "WINDOWED": True}
    constexprs |= {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "USE_PDL": True}
    if not decode:
        constexprs |= {"DECODE": False, "SPLIT_KV": False, "ORDERED": False, "BLOCK_Q": cfg.block_m // 2}
    signature = {a: "constexpr" if a in constexprs else _arg_type(a) for a in _paged_attn_kernel.arg_names}
    src = ASTSource(fn=_paged_attn_kernel, signature=signature, constexprs=constexprs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared


def _gluon_compile(
    fn: Any,
    constexprs: dict[str, Any],
    types: dict[str, str],
    dtype: str,
    warps: int,
    unaligned: tuple[str, ...],
) -> Any:
    """A Gluon kernel compiled for sm_90: arguments typed by `types`, other pointers `dtype`, other scalars i32,
    every non-constexpr argument but `unaligned` (and float scalars) marked divisible by 16, as launches
    specialise them."""
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {
        a: "constexpr" if a in constexprs else types.get(a, dtype if a.endswith("_ptr") else "i32")
        for a in fn.arg_names
    }
    plain = ("constexpr", "fp32")
    aligned = [i for i, a in enumerate(fn.arg_names) if signature[a] not in plain and a not in unaligned]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def _wint_mma_compile(constexprs: dict[str, Any], dtype: str = "*bf16") -> Any:
    from tinypaged.kernels.lowbit_mma import _wint_mma_kernel as fn

    types = {"w_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8", "part_ptr": "*fp32", "count_ptr": "*i32"}
    return _gluon_compile(fn, constexprs, types, dtype, constexprs["WARPS"], ("M",))


@pytest.mark.parametrize(
    ("bits", "block_m", "split", "stages", "zeros", "l2", "wide"),
    [(4, 8, 1, 0, True, 0, False), (4, 8, 8, 0, True, 128, False), (4, 16, 2, 0, True, 128, False)]
    + [(4, 8, 1, 4, True, 0, False), (4, 8, 8, 3, False, 0, False), (4, 8, 2, 0, False, 256, False)]
    + [(8, 8, 1, 0, False, 0, False), (8, 16, 4, 0, True, 0, False), (8, 8, 2, 4, False, 0, False)]
    + [(8, 8, 2, 0, True, 64, False), (4, 8, 2, 0, True, 128, True), (4, 16, 8, 0, False, 0, True)],
)
def test_wint_mma_kernel_compiles_for_hopper(
    bits: int, block_m: int, split: int, stages: int, zeros: bool, l2: int, wide: bool
) -> None:
    """The Gluon INT4 / INT8 kernel (kernels/lowbit_mma.py) compiles for sm_90 with its operands loaded into
    mma.sync's registers, the activations in 16-byte loads after the wait on the kernel before (programmatic
    dependent launch), the codes turned into bf16 or fp16 pairs by the inline PTX (INT4: a packed fma; INT8: a
    float32 subtraction and a conversion of the pair), 32 / bits dots a step. The packed words: with no ring
    (stages 0) in 8-byte loads, the first step's before the wait, and no shared memory but a split's one
    broadcast of its counter; with a ring, 16-byte cp.async into shared memory, the first stages - 1 steps'
    before the wait, stages - 2 groups left in flight at each step's wait, read back in 8-byte shared loads.
    Without a ring, each word load through the read-only path with an L2 prefetch size where `l2` names one; `wide`
    (INT4), the words in 16-byte loads (four neighbouring words a thread), relabelled into the operand's layout
    without moving a register between threads (the kernel's `assert_trivial`)."""
    from tinypaged.kernels.lowbit_mma import mma_config

    block_n, warps = mma_config(1, 4096, 4096, bits=bits)[:2]
    constexprs = {"BITS": bits, "HAS_ZERO": zeros, "HAS_BIAS": False, "SPLIT": split, "BLOCK_M": block_m}
    constexprs |= {
        "BLOCK_N": block_n,
        "WARPS": warps,
        "STAGES": stages,
        "L2": l2,
        "WIDE": wide,
        "USE_PDL": True,
    }
    for dtype, pair in (("*bf16", ".bf16"), ("*fp16", ".f16")):
        kernel = _wint_mma_compile(constexprs, dtype)
        ptx = kernel.asm["ptx"]
        assert f"mma.sync.aligned.m16n8k16.row.col.f32{pair}{pair}.f32" in ptx
        wait = ptx.index("griddepcontrol.wait")
        assert ptx.find("ld.global.v4", wait) > wait  # the activations after it
        if bits == 4:
            assert f"fma.rn{pair}x2" in ptx and "lop3.b32" in ptx and "prmt.b32" in ptx
        else:
            assert f"cvt.rn{pair}x2.f32" in ptx and "0x7653" in ptx and "sub.f32" in ptx
        # A loop's dots: eight INT4 code positions a step, four INT8 ones (the tiles a warp times that).
        assert ptx.count("mma.sync") % (32 // bits) == 0
        if stages == 0:
            v = "v4" if wide else "v2"
            load = f"ld.global.nc.L2::{l2}B.{v}.u32" if l2 else f"ld.global.{v}.b32"
            assert (
                "L2::" not in ptx.replace(load, "") and ptx.find(load) < wait
            )  # the first step's words before it
            # a thread's words of a step: two 8-byte loads a row (wide: one 16-byte load), four rows a 32-row
            # tile pair
            loads = [i for i in range(len(ptx)) if ptx.startswith(load, i)]
            assert sum(i < wait for i in loads) == (1 if wide else 2) * (block_n // (8 * warps))
            assert not wide or "ld.global.v2.b32" not in ptx[:wait]
            # Shared memory only where a split's last program learns it is the last (its counter broadcast).
            assert ptx.count("ld.shared") == ptx.count("st.shared") == (split > 1)
            assert "cp.async" not in ptx
        else:
            copies = [i for i in range(len(ptx)) if ptx.startswith("cp.async.cg.shared.global", i)]
            assert sum(c < wait for c in copies) == (stages - 1) * block_n * 16 * 4 // (16 * 32 * warps)
            assert all(", 0x10," in ptx[c : ptx.index(";", c)] for c in copies)  # 16 bytes a copy
            assert re.search(rf"cp\.async\.wait_group\s+{stages - 2};", ptx)
            assert "ld.shared.v2.b32" in ptx
            assert kernel.metadata.shared >= stages * block_n * 64


def _registers(kernel: Any) -> tuple[int, int]:
    """Registers a thread of a compiled kernel and its stack bytes (spills), read from its cubin by the cuobjdump
    that ships with Triton."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton.backends.nvidia as nvidia

    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        tool = Path(nvidia.__path__[0]) / "bin" / "cuobjdump"
        usage = subprocess.run(
            [str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True
        )
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    return int(found.group(1)), int(found.group(2))


def test_wint_mma_registers_at_16_rows() -> None:
    """`mma_config` splits an INT4 layer of 9-16 rows by how many programs a multiprocessor holds, from
    `REGS_16`'s registers a thread: the compiled kernel, with or without zero points, needs no more than the table
    says, and the table's figure is one of the two schemes' own (no stale headroom); neither spills."""
    from tinypaged.kernels.lowbit_mma import REGS_16

    for (bits, reps), want in REGS_16.items():
        counts = []
        for zeros in (True, False):
            warps = 8 // reps
            constexprs = {"BITS": bits, "HAS_ZERO": zeros, "HAS_BIAS": False, "SPLIT": 8, "BLOCK_M": 16}
            constexprs |= {
                "BLOCK_N": 16 * reps * warps,
                "WARPS": warps,
                "STAGES": 0,
                "L2": 128,
                "WIDE": False,
                "USE_PDL": True,
            }
            regs, stack = _registers(_wint_mma_compile(constexprs))
            assert stack == 0, (bits, reps, zeros)
            counts.append(regs)
        assert max(counts) == want, (bits, reps, counts)


def test_int8_gemv_registers() -> None:
    """`gemv_config` sizes a wave of INT8's one-row GEMV (the PTX chain, four warps) by `GEMV_PTX_REGS`'s registers
    a thread: the compiled kernel, with or without zero points, needs no more than the table says, and the table's
    figure is one of the two schemes' own; neither spills."""
    from tinypaged.kernels.lowbit import GEMV_PTX_REGS

    base = {"GROUP": 128, "BITS": 8, "HAS_BIAS": False, "SPLIT": True, "BLOCK_K": 128, "ASM": True}
    base |= {"USE_PDL": True, "BLOCK_M": 1, "DOT": False, "SWAP_AB": True, "IEEE": False}
    for block_n, want in GEMV_PTX_REGS.items():
        counts = []
        for zeros in (True, False):
            regs, stack = _registers(
                _lowbit_compile("_wint_kernel", base | {"BLOCK_N": block_n, "HAS_ZERO": zeros})
            )
            assert stack == 0, (block_n, zeros)
            counts.append(regs)
        assert max(counts) == want, (block_n, counts)


@pytest.mark.parametrize(
    ("head_dim", "split"), [(128, False), (128, True), (64, True), (32, False), (16, True)]
)
def test_fp8_decode_attention_kernel_compiles_for_hopper(head_dim: int, split: bool) -> None:
    """The Gluon decode attention over an FP8 cache (kernels/attention_fp8.py) compiles for sm_90 with its K and V
    tiles loaded straight into mma.sync's operand registers: no shared memory, a thread's bytes of a key in runs
    (16-byte loads at 128 head dimensions: 4 keys' K and 8 keys' V a thread a 32-key step), E4M3 pairs converted
    in registers, fp16 dots with float32 sums."""
    from tinypaged.kernels.attention_fp8 import BLOCK_N, o_layout, q_raw_layout, raw_layouts
    from tinypaged.kernels.attention_fp8 import _fp8_decode_kernel as fn

    k_raw, v_raw = raw_layouts(head_dim, BLOCK_N)
    constexprs = {"G": 4, "HEAD_DIM": head_dim, "BLOCK_SIZE": 16, "BLOCK_N": BLOCK_N, "K_RAW": k_raw}
    constexprs |= {"V_RAW": v_raw, "Q_RAW": q_raw_layout(head_dim), "O_LAYOUT": o_layout(head_dim)}
    constexprs |= {"SPLIT_KV": split, "ORDERED": True, "USE_PDL": True}
    types = {
        "kv_ptr": "*u8",
        "part_o_ptr": "*fp32",
        "part_ml_ptr": "*fp32",
        "qk_scale": "fp32",
        "v_scale": "fp32",
    }
    types |= {a: "*i32" for a in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "seq_order_ptr")}
    ptx = _gluon_compile(fn, constexprs, types, "*bf16", 1, ("num_seqs", "num_splits")).asm["ptx"]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert ptx.count("mma.sync") == 2 * (head_dim // 16) * (
        BLOCK_N // 8
    )  # S: K steps x key tiles; O the same
    assert (
        ptx.count("cvt.rn.f16x2.e4m3x2") == 2 * BLOCK_N * head_dim // 32 // 2
    )  # a step's K and V, a pair each
    assert "ld.shared" not in ptx and "st.shared" not in ptx
    if head_dim == 128:  # K: 32-byte runs, V: 16-byte runs, in 16-byte loads; Q and O in runs too
        assert ptx.count("ld.global.v4.b32") == 4 * 2 + 8 + 8  # a step's K and V; Q's 2 rows x 64 bytes
        assert ptx.count("st.global.v4.b32") == (16 if split else 8)  # O's 2 rows x 32 columns a thread
        assert "st.global.b16" not in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
