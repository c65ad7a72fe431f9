"""GGUF blocks repacked into the INT4 / INT8 layout: the reference dequantization equals `gguf`'s own, bit for bit.

Blocks come from `gguf`'s quantizer where it has one (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and from random bytes with
finite float16 headers for the K-quants (every code, scale and min pattern a block can hold), written to a file
by `gguf`'s writer and read back by its reader, as the loader reads them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tinypaged.model.quant import lowbit
from tinypaged.weights import WeightsError
from tinypaged.weights.gguf_quant import BLOCKS, repack

gguf = pytest.importorskip("gguf")
QUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of each block's float16 fields


def _blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in QUANTIZED:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        w[0, :32] = 0.0  # an all-zero block (scale 0)
        w[1, :32] = np.abs(w[1, :32]) + 1.0  # a block with a positive minimum
        return gguf.quants.quantize(w, qtype)
    per, size = BLOCKS[kind]
    raw = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    for at in F16_FIELDS[kind]:  # random finite float16 values of both signs, subnormals included
        halves = rng.standard_normal(len(raw)).astype(np.float16) * np.float16(0.01)
        halves[:4] = [0.0, -0.0, np.float16(6e-8), np.float16(-65504)]
        raw[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def _written(tmp_path: Path, kind: str, blocks: np.ndarray, rows: int, cols: int):
    path = tmp_path / f"{kind}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(path).tensors[0]


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_repacked_weights_equal_gguf_dequantization_bit_for_bit(tmp_path: Path, kind: str) -> None:
    rows, cols = 6, 512
    tensor = _written(tmp_path, kind, _blocks(kind, rows, cols, np.random.default_rng(0)), rows, cols)
    assert tensor.tensor_type.name == kind
    oracle = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(rows, cols)
    assert np.isfinite(oracle).all()
    w = repack("w", kind, tensor.data, rows, cols)
    ours = lowbit.dequantize_weight(w).numpy()
    assert ours.dtype == np.float32 and ours.shape == (rows, cols)
    assert np.array_equal(ours.view(np.uint32), oracle.astype(np.float32).view(np.uint32))  # signed zeros too
    bits, group = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32), "Q6_K": (8, 16)}.get(kind, (8, 32))
    assert (w.bits, w.group, w.zeros) == (bits, group, None)
    assert (w.mins is not None) == (kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"))
    assert w.qweight.shape == (rows, cols * bits // 32) and w.scales.shape == (cols // group, rows)


def test_repacked_linear_matches_dequantized_matmul() -> None:
    rng = np.random.default_rng(1)
    w = repack("w", "Q4_K", _blocks("Q4_K", 4, 256, rng), 4, 256)
    x = lowbit.torch.from_numpy(rng.standard_normal((3, 256)).astype(np.float32))
    want = x @ lowbit.dequantize_weight(w).T
    assert lowbit.torch.equal(lowbit.wint_linear(x, w), want)


def test_unsupported_type_and_short_data_name_the_tensor() -> None:
    with pytest.raises(WeightsError, match=r"blk\.0\.attn_q\.weight: GGUF type IQ2_XS is not kept quantized"):
        repack("blk.0.attn_q.weight", "IQ2_XS", np.zeros(10, np.uint8), 1, 256)
    with pytest.raises(WeightsError, match=r"blk\.1\.ffn_up\.weight: 40 bytes of Q4_0 do not hold a 2 x 64"):
        repack("blk.1.ffn_up.weight", "Q4_0", np.zeros(40, np.uint8), 2, 64)
