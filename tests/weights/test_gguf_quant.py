"""GGUF blocks repacked into the INT4 / INT8 layout: the reference dequantization equals `gguf`'s own, bit for bit.

Blocks come from `gguf`'s quantizer where it has one (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and from random bytes with
finite float16 headers for the K-quants (every code, scale and min pattern a block can hold), written to a file
by `gguf`'s writer and read back by its reader, as the loader reads them.
"""

from __future__ import annotations

import json
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


# A tiny Llama in GGUF, each linear layer of its own type (fused parts share one), hidden and FFN widths that
# K-quants' 256-weight blocks divide.
HIDDEN, FFN = 256, 512
LAYER_TYPES = [
    {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_1"}
    | {"ffn_gate": "Q5_0", "ffn_up": "Q5_0", "ffn_down": "Q5_1"},
    {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q4_K"}
    | {"ffn_gate": "Q5_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K"},
]
SHAPES = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256)} | {
    "ffn_gate": (FFN, HIDDEN),
    "ffn_up": (FFN, HIDDEN),
    "ffn_down": (HIDDEN, FFN),
}


def write_tiny_llama(
    path: Path,
    default_gguf: Path,
    layer_types: list[dict[str, str]],
    overrides: dict[str, tuple] | None = None,
) -> None:
    """A random 2-layer Llama with the default model's vocabulary, its linear layers in `layer_types`;
    `overrides`: metadata keys set over the written ones (key -> (value, GGUFValueType))."""
    from tinypaged.weights.gguf_metadata import read_metadata

    meta = read_metadata(gguf.GGUFReader(default_gguf))
    rng = np.random.default_rng(2)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(len(layer_types))
    w.add_feed_forward_length(FFN)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(1e4)
    w.add_tokenizer_model("gpt2")
    tok = {k.removeprefix("tokenizer.ggml."): v for k, v in meta.items()}
    for add, key in (
        (w.add_tokenizer_pre, "pre"),
        (w.add_token_list, "tokens"),
        (w.add_token_types, "token_type"),
        (w.add_token_merges, "merges"),
        (w.add_bos_token_id, "bos_token_id"),
        (w.add_eos_token_id, "eos_token_id"),
    ):
        add(tok[key])
    vocab = len(meta["tokenizer.ggml.tokens"])
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, HIDDEN)).astype(np.float32) * 0.1)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i, types in enumerate(layer_types):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, np.float32))
        for name, kind in types.items():
            rows, cols = SHAPES[name]
            if kind in BLOCKS:
                blocks = _blocks(kind, rows, cols, rng)
            else:  # a type that is not repacked: bytes of the right size
                per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
                blocks = rng.integers(0, 256, (rows, cols // per * size), dtype=np.uint8)
                blocks.reshape(-1, size)[:, -4:] = 0  # Q2_K's float16 d and dmin: zero, finite
            w.add_tensor(f"blk.{i}.{name}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
    for key, (value, kind) in (overrides or {}).items():
        w.add_key_value(key, value, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_llama(path, gguf_path, LAYER_TYPES)
    return path


def _loads_bit_for_bit(path: Path, out: Path) -> list:
    """Convert `path` to f32 and kept quantized under `out`; every quantized layer's weight, dequantized, equals
    the f32 conversion's (gguf's dequantization) bit for bit. The two models, and the quantized config's types."""
    import torch

    from tinypaged.config import ModelConfig
    from tinypaged.model.loader import load_model
    from tinypaged.model.quant import Linear
    from tinypaged.weights import convert_gguf

    convert_gguf(path, out / "f32")
    convert_gguf(path, out / "q", keep_quantized=True)
    models = [
        load_model(ModelConfig.from_dir(out / d), torch.float32, torch.device("cpu"), 64)
        for d in ("f32", "q")
    ]
    dense = {n: m for n, m in models[0].named_modules() if isinstance(m, Linear)}
    checked = 0
    for name, layer in models[1].named_modules():
        if isinstance(layer, Linear) and hasattr(layer, "qweight"):
            ours = lowbit.dequantize_weight(layer.method.weight(layer))
            assert torch.equal(ours.view(torch.int32), dense[name].weight.view(torch.int32)), name
            checked += 1
    assert checked == 8  # qkv, o, gate_up and down of both layers
    kinds = json.loads((out / "q" / "config.json").read_text())["quantization_config"]["layers"]
    return [*models, kinds]


def test_kept_quantized_model_loads_the_gguf_weights_bit_for_bit(tiny: Path, tmp_path: Path) -> None:
    """Every type through the converter, the loader and the fused layers' parts (Q and K rows un-permuted):
    each layer's weight, dequantized, is the f32 conversion's (gguf's dequantization) bit for bit."""
    kinds = _loads_bit_for_bit(tiny, tmp_path)[2]
    assert sorted(set(kinds.values())) == sorted(BLOCKS)


# A Q4_K_M file's layers (Q4_K, with Q6_K for v and down), and fused parts of three different types.
MIXED_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K"}
    | {"ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q4_0", "attn_k": "Q8_0", "attn_v": "Q5_1", "attn_output": "Q5_K"}
    | {"ffn_gate": "Q4_1", "ffn_up": "Q8_0", "ffn_down": "Q4_K"},
]


def test_fused_parts_of_different_types_load_bit_for_bit(tmp_path: Path, gguf_path: Path, run_paged) -> None:
    """q, k and v (or gate and up) of different types, which the engine runs as one matmul, are written in one
    layout (8-bit codes, zero points and mins, the smallest group): still gguf's weights bit for bit, and the
    model on the CPU's kernels (every layer packed: groups of 16 padded) computes as the f32 conversion within the
    kernels' bf16 rounding."""
    import torch

    from tinypaged.config import ModelConfig
    from tinypaged.model.loader import load_model
    from tinypaged.quantization import resolve_quantization

    write_tiny_llama(tmp_path / "mixed.gguf", gguf_path, MIXED_TYPES)
    f32, _, kinds = _loads_bit_for_bit(tmp_path / "mixed.gguf", tmp_path)
    assert kinds["model.layers.0.self_attn.v_proj"] == "Q4_K+Q6_K" == kinds["model.layers.0.self_attn.q_proj"]
    assert kinds["model.layers.0.mlp.gate_proj"] == "Q4_K" and kinds["model.layers.0.mlp.down_proj"] == "Q6_K"
    assert kinds["model.layers.1.self_attn.k_proj"] == "Q4_0+Q5_1+Q8_0"
    assert kinds["model.layers.1.mlp.up_proj"] == "Q4_1+Q8_0"
    raw = {"quant_method": "gguf", "layers": kinds}
    scheme = resolve_quantization(raw, None, "m", 2, False).scheme("model.layers.0.self_attn.q_proj")
    assert (scheme.bits, scheme.group, scheme.zero_points, scheme.mins) == (8, 16, True, True)
    cpu = load_model(
        ModelConfig.from_dir(tmp_path / "q"), torch.float32, torch.device("cpu"), 64, cpu_kernels=True
    )
    packed = [m.cpu_packed is not None for m in cpu.modules() if hasattr(m, "cpu_packed")]
    assert all(packed) and len(packed) == 8  # groups of 16 (Q6_K's) padded to the kernel's 32
    prompts, decodes = [[5, 9, 200, 7], [30] * 9], [[11, 12], [13, 14]]
    for got, want in zip(
        run_paged(cpu, prompts, 4, decodes), run_paged(f32, prompts, 4, decodes), strict=True
    ):
        assert (got - want).abs().max() < 2e-2 * want.abs().max()


def test_a_q4_k_m_layer_runs_in_the_cpu_decode_graph(tmp_path: Path, gguf_path: Path, monkeypatch) -> None:
    """The mixed layout (zero points and mins) and Q6_K's padded groups of 16 through the CPU's compiled decode
    step (model/cpu_graph.py): the same tokens and logprobs as the eager engine."""
    from tinypaged import LLM, SamplingParams
    from tinypaged.model import cpu_graph

    monkeypatch.setenv(cpu_graph.ENV, "1")
    monkeypatch.setattr(cpu_graph, "graph_dir", lambda: tmp_path / "graphs")
    write_tiny_llama(tmp_path / "mixed.gguf", gguf_path, MIXED_TYPES)
    llm = LLM(model=tmp_path / "mixed.gguf", seed=0)
    runner = llm.engine.runner
    assert runner.stats.cpu_reference_layers == 0  # every layer on torch's kernels
    graph = runner.cpu_graph
    assert graph is not None and [lin.padded for lin in graph.spec.layers[0].linears] == [
        True,
        False,
        False,
        True,
    ]
    assert graph.wait(600) == "loaded"
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 200, 7], [30] * 21)]
    got = [o.outputs[0] for o in llm.generate(prompts, sp)]
    runner.cpu_graph = None
    want = [o.outputs[0] for o in llm.generate(prompts, sp)]
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for lg, lw in zip(g.logprobs, w.logprobs, strict=True):
            assert max(abs(lg[t].logprob - lw[t].logprob) for t in lg.keys() & lw.keys()) < 2e-2
    llm.shutdown()


def test_unsupported_type_fails_at_load_naming_tensor_and_type(tmp_path: Path, gguf_path: Path) -> None:
    from tinypaged.weights import convert_gguf

    types = [LAYER_TYPES[0], LAYER_TYPES[1] | {"ffn_down": "Q2_K"}]
    write_tiny_llama(tmp_path / "q2k.gguf", gguf_path, types)
    with pytest.raises(WeightsError, match=r"blk\.1\.ffn_down\.weight: GGUF type Q2_K is not kept quantized"):
        convert_gguf(tmp_path / "q2k.gguf", tmp_path / "out", keep_quantized=True)
    assert not (tmp_path / "out").exists()  # nothing written before every tensor is read


def _corrupt(data: bytes, how: str) -> bytes:
    """The tiny GGUF with one header field made absurd, or cut short."""
    import struct

    name = b"blk.1.ffn_down.weight"  # its info: name, n_dims (u32), dims (u64 each), type (u32), offset (u64)
    at = data.index(name) + len(name)
    dims = at + 4
    patch = {
        "tensor count": (8, struct.pack("<Q", 1 << 60)),
        "metadata count": (16, struct.pack("<Q", 1 << 60)),
        "dim": (dims, struct.pack("<Q", 1 << 40)),
        "dim overflow": (dims, struct.pack("<Q", 1 << 63)),
        "type": (dims + 16, struct.pack("<I", 999)),
        "offset past the end": (dims + 20, struct.pack("<Q", 1 << 50)),
    }
    if how == "truncated":
        return data[:-100]
    if how == "string":  # the architecture's name no longer UTF-8 (the reader decodes values lazily)
        at = data.index(b"llama", data.index(b"general.architecture") + len(b"general.architecture"))
        return data[:at] + b"\xff\xfe" + data[at + 2 :]
    pos, value = patch[how]
    return data[:pos] + value + data[pos + len(value) :]


@pytest.mark.parametrize(
    "how",
    [
        "truncated",
        "tensor count",
        "metadata count",
        "dim",
        "dim overflow",
        "type",
        "offset past the end",
        "string",
    ],
)
def test_corrupt_gguf_is_one_clear_error_and_writes_nothing(tmp_path: Path, how: str) -> None:
    from tinypaged.weights import convert_gguf, fetch

    good = tmp_path / "good.gguf"
    w = gguf.GGUFWriter(str(good), "llama")
    w.add_block_count(2)
    rng = np.random.default_rng(3)
    for name in ("blk.0.ffn_down.weight", "blk.1.ffn_down.weight", "blk.1.ffn_norm.weight"):
        kind = "Q4_K" if name.endswith("down.weight") else "F32"
        data = _blocks(kind, 4, 256, rng) if kind != "F32" else np.ones(8, np.float32)
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gguf.GGUFReader(good)  # the file before the damage is sound
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_corrupt(good.read_bytes(), how))
    for keep in (False, True):
        with pytest.raises(WeightsError, match="truncated or not a GGUF file"):
            convert_gguf(bad, tmp_path / "out", keep_quantized=keep)
        assert not (tmp_path / "out").exists()
    home = tmp_path / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINYPAGED_HOME", str(home))
        with pytest.raises(WeightsError):
            fetch.resolve_model(bad)
    assert not list((home / "models" / "gguf").iterdir())  # no model directory, half-written or not


def test_gguf_scheme_resolution_refuses_in_one_line() -> None:
    from tinypaged.errors import ConfigError
    from tinypaged.quantization import GGUF_TYPES, resolve_quantization

    layers = {f"model.layers.0.{m}": "Q5_0" for m in ("self_attn.q_proj", "self_attn.k_proj")}
    raw = {"quant_method": "gguf", "layers": layers | {"model.layers.0.self_attn.v_proj": "Q8_0"}}
    quant = resolve_quantization(raw, "gguf", "m", 1, False)  # Q5_0 and Q8_0: one scheme, one matmul
    assert quant is not None and str(quant.scheme("model.layers.0.self_attn.v_proj")).startswith("int8")
    with pytest.raises(ConfigError, match="quantized differently"):
        resolve_quantization(
            raw | {"layers": layers | {"model.layers.0.self_attn.v_proj": "Q6_K"}}, None, "m", 1, False
        )
    with pytest.raises(ConfigError, match="layer model.layers.0.self_attn.q_proj is GGUF type 'Q2_K'"):
        resolve_quantization(
            {"quant_method": "gguf", "layers": {"model.layers.0.self_attn.q_proj": "Q2_K"}},
            None,
            "m",
            1,
            False,
        )
    with pytest.raises(ConfigError, match=r"no quantization_config \(pass the .gguf file\)"):
        resolve_quantization(None, "gguf", "m", 1, False)
    for kind, (bits, group, mins) in GGUF_TYPES.items():  # the resolver's table is the repacking's
        w = repack("w", kind, _blocks(kind, 4, 256, np.random.default_rng(4)), 4, 256)
        assert (w.bits, w.group, w.mins is not None) == (bits, group, mins), kind


@pytest.mark.parametrize("merges", [["Ġ"], ["Ġt qqqzzzxx"]], ids=["one-token merge", "merge of no token"])
def test_a_damaged_tokenizer_is_one_clear_error(gguf_path: Path, merges: list[str]) -> None:
    """What the `tokenizers` library refuses of a GGUF's vocabulary or merges (a bare Exception, or a TypeError
    over several lines) is one WeightsError line."""
    from tinypaged.weights.gguf_metadata import read_metadata
    from tinypaged.weights.gguf_tokenizer import build_tokenizer

    meta = read_metadata(gguf.GGUFReader(gguf_path))
    with pytest.raises(WeightsError, match="tokenizer cannot be built from its metadata") as err:
        build_tokenizer(meta | {"tokenizer.ggml.merges": merges})
    assert "\n" not in str(err.value)
