"""GGUF's quantized blocks repacked, losslessly, into the weight-only INT4 / INT8 layout of model/quant/lowbit.py.

Each type's codes, scales and offsets are read from its blocks as llama.cpp lays them out (ggml-common.h) and
stored so that `lowbit.dequantize_weight` repeats GGUF's own float32 arithmetic step for step, which makes the
weights bit-for-bit those of `gguf.quants.dequantize` (tests/weights/test_gguf_quant.py checks every type):

| type | block | GGUF's weight | repacked | code |
|---|---|---|---|---|
| Q4_0 | 32 | `d * (q - 8)` | INT4, group 32, symmetric, scale `d` | q |
| Q4_1 | 32 | `d * q + m` | INT4, group 32, scale `d`, min `m` | q |
| Q5_0 | 32 | `d * (q - 16)` | INT8, group 32, symmetric, scale `d` | q + 112 |
| Q5_1 | 32 | `d * q + m` | INT8, group 32, scale `d`, min `m` | q |
| Q8_0 | 32 | `d * q` (q signed) | INT8, group 32, symmetric, scale `d` | q + 128 |
| Q4_K | 256 | `(d * sc) * q - dmin * m` | INT4, group 32, scale `d * sc`, min `-(dmin * m)` | q |
| Q5_K | 256 | `(d * sc) * q - dmin * m` | INT8, group 32, scale `d * sc`, min `-(dmin * m)` | q |
| Q6_K | 256 | `(d * sc) * (q - 32)` | INT8, group 16, symmetric, scale `d * sc` | q + 96 |

`d`, `dmin` and `m` are float16 (exact in float32); `sc` and `m` of the K-quants are 6-bit integers (Q6_K's `sc`
a signed byte), so `d * sc` is one float32 product, computed here as GGUF computes it (and exact: an 11-bit
significand times an integer below 2^8). `x - y` and `x + (-y)` are the same IEEE operation, so a negated min
changes nothing. 5-bit codes take a byte (INT8 codes): exact, at 8 bits a weight where GGUF spends 5.5 to 6; a
5-bit packing is for the kernels' slice.

Parts that the engine fuses into one matmul (q, k and v; gate and up) must share a layout. Where their types
repack to different ones (a Q4_K_M file's Q4_K q and k with a Q6_K v), `one_layout_a_fused_layer` rewrites them
in one that holds each exactly: 8-bit codes, the smallest group, and a zero point and a min a group, the weight
`(code - zero) * scale + min`.
"""

from __future__ import annotations

import numpy as np
import torch

from tinypaged.model.quant import lowbit

from .errors import WeightsError

# type name -> (weights a block, bytes a block)
BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}


def _f16(b: np.ndarray) -> np.ndarray:
    """Float16 fields (2 bytes each, last axis) as float32 `[..., 1]` per block."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes `[B, n]` as their 2n nibbles: the n low ones first, then the n high ones (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """The first `count` bits of each block's little-endian bytes `[B, count / 8]`, bit i at index i."""
    return np.unpackbits(qh, axis=-1, count=count, bitorder="little")


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit sub-block scales and mins: (sc, m), each `[B, 8]` uint8. Sub-blocks 0-3
    keep 6 bits in bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 their low 4 bits in bytes 8-11 (low nibble
    the scale, high the min) and their top 2 bits in the top bits of bytes 0-3 and 4-7."""
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def _unpack_blocks(
    kind: str, blocks: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int, int]:
    """(codes `[B, block]` uint8, scales `[B, groups]` float32, mins or None, bits, group) of raw blocks `[B,
    bytes]`."""
    if kind in ("Q4_0", "Q5_0", "Q8_0"):
        d = _f16(blocks[:, :2])
        if kind == "Q8_0":
            return (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, None, 8, 32
        if kind == "Q4_0":
            return _nibbles(blocks[:, 2:]), d, None, 4, 32
        q = _nibbles(blocks[:, 6:]) | (_bits(blocks[:, 2:6], 32) << 4)
        return q + 112, d, None, 8, 32
    if kind in ("Q4_1", "Q5_1"):
        d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        if kind == "Q4_1":
            return _nibbles(blocks[:, 4:]), d, m, 4, 32
        return _nibbles(blocks[:, 8:]) | (_bits(blocks[:, 4:8], 32) << 4), d, m, 8, 32
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scales(blocks[:, 4:16])
        scale = d * sc.astype(np.float32)
        mins = -(dmin * mn.astype(np.float32))
        qs = blocks[:, 16:144] if kind == "Q4_K" else blocks[:, 48:176]
        # each 32 bytes hold two sub-blocks: the low nibbles one, the high nibbles the next
        q = _nibbles(qs.reshape(-1, 32)).reshape(len(blocks), 256)
        if kind == "Q4_K":
            return q, scale, mins, 4, 32
        hi = _bits(blocks[:, 16:48], 256).reshape(-1, 32, 8).transpose(0, 2, 1).reshape(-1, 256)
        return q | (hi << 4), scale, mins, 8, 32
    if kind == "Q6_K":
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(blocks[:, 208:210])
        # per half of 128 weights: 64 bytes of low nibbles (weights 0-63, then 64-127), 32 bytes of 2-bit tops
        # (weights j, 32 + j, 64 + j, 96 + j in bits 0-1, 2-3, 4-5, 6-7 of byte j)
        lo = _nibbles(ql.reshape(-1, 64)).reshape(len(blocks), 256)
        tops = qh.reshape(-1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
        hi = (tops & 3).reshape(len(blocks), 256)
        return (lo | (hi << 4)) + 96, d * sc, None, 8, 16
    raise AssertionError(kind)


def repack(name: str, kind: str, data: np.ndarray, rows: int, cols: int) -> lowbit.IntWeight:
    """The `rows` x `cols` weight `name`, GGUF blocks `data` of type `kind` (uint8, `rows` x bytes a row), as a
    lowbit.IntWeight on the CPU; WeightsError where the type is not repacked or the bytes do not fit the shape."""
    if kind not in BLOCKS:
        raise WeightsError(f"{name}: GGUF type {kind} is not kept quantized (repacked: {', '.join(BLOCKS)})")
    per, size = BLOCKS[kind]
    if cols % per or data.size != rows * (cols // per) * size:
        raise WeightsError(
            f"{name}: {data.size} bytes of {kind} do not hold a {rows} x {cols} weight ({per} weights in {size} bytes)"
        )
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, size)
    codes, scales, mins, bits, group = _unpack_blocks(kind, blocks)
    codes = torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, cols)))

    def per_group(t: np.ndarray) -> torch.Tensor:  # [blocks, groups] -> [K / group, N]
        return torch.from_numpy(np.ascontiguousarray(t.reshape(rows, cols // group).T, dtype=np.float32))

    return lowbit.IntWeight(
        lowbit.pack(codes, bits),
        per_group(scales),
        None,
        bits,
        group,
        None if mins is None else per_group(mins),
    )


def one_layout_a_fused_layer(tensors: dict[str, np.ndarray], kinds: dict[str, str], layers: int) -> None:
    """Parts that the engine fuses into one matmul (q, k and v; gate and up) but whose GGUF types repack to
    different layouts (a Q4_K_M file's Q4_K q and k with a Q6_K v) rewritten in one: 8-bit codes, the smallest
    group, a zero point and a min a group (`(code - zero) * scale + min`: a 4-bit type's codes as they are, its
    scale and min repeated over the smaller groups; a symmetric type's zero point 2^(bits - 1) and min -0.0), so
    that each weight is still the file's bit for bit. Each such part's type becomes the types joined by "+"."""
    from tinypaged.quantization import FUSED_GROUPS, GGUF_TYPES

    for i in range(layers):
        for fused in FUSED_GROUPS:
            names = [f"model.layers.{i}.{m}" for m in fused]
            types = [kinds.get(n) for n in names]
            if None in types or any(t not in GGUF_TYPES for t in types):
                continue
            if len({GGUF_TYPES[t] for t in types}) == 1:  # one layout already (Q5_0 and Q8_0)
                continue
            group = min(GGUF_TYPES[t][1] for t in types)
            joined = "+".join(sorted(set(types)))
            for name, kind in zip(names, types, strict=True):
                bits, own, mins = GGUF_TYPES[kind]
                codes = lowbit.unpack(torch.from_numpy(tensors[f"{name}.qweight"]), bits)
                scales = np.repeat(tensors[f"{name}.scales"], own // group, axis=0)  # [K / group, N]
                m = tensors.pop(f"{name}.mins", None)
                tensors[f"{name}.qweight"] = lowbit.pack(codes, 8).numpy()
                tensors[f"{name}.scales"] = scales
                # A symmetric type's min is -0.0, which adds nothing: + 0.0 would turn a weight of -0.0 into 0.0.
                no_min = np.full_like(scales, -0.0)
                tensors[f"{name}.mins"] = no_min if m is None else np.repeat(m, own // group, 0)
                zero = 0 if mins else 1 << (bits - 1)
                tensors[f"{name}.zeros"] = np.full(scales.shape, zero, dtype=np.uint8)
                kinds[name] = joined
