"""A GGUF's metadata checked where it is read (weights/gguf_metadata.py): a damaged or hostile value (a count of
0 or 2^40, a string for a number, a token id out of the vocabulary) is one WeightsError naming its key, before a
division, a loop over the layers or a file written."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tinypaged.weights import WeightsError

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def meta(gguf_path: Path) -> dict[str, Any]:
    from tinypaged.weights.gguf_metadata import open_gguf, read_metadata

    return read_metadata(open_gguf(gguf_path))


HOSTILE = [
    ("llama.attention.head_count", 0),
    ("llama.attention.head_count", [9] * 30),  # one count a layer: not a model this converter reads
    ("llama.attention.head_count_kv", -3),
    ("llama.block_count", 2**40),
    ("llama.embedding_length", "576"),
    ("llama.feed_forward_length", True),
    ("llama.context_length", 2**31),
    ("llama.vocab_size", 1.5),
    ("llama.rope.dimension_count", None),
    ("llama.rope.freq_base", 0.0),
    ("llama.rope.freq_base", "x"),
    ("llama.attention.layer_norm_rms_epsilon", math.nan),
    ("general.architecture", ["llama"]),
    ("tokenizer.ggml.tokens", 5),
    ("tokenizer.ggml.bos_token_id", 10**9),
    ("tokenizer.ggml.eos_token_id", 1.5),
    ("tokenizer.ggml.padding_token_id", -1),
    ("tokenizer.ggml.unknown_token_id", 49152),  # one past the vocabulary
]


@pytest.mark.parametrize(("key", "value"), HOSTILE)
def test_a_hostile_value_is_one_error_naming_its_key(meta: dict[str, Any], key: str, value: Any) -> None:
    from tinypaged.weights.gguf_metadata import hf_config, tokenizer_config

    bad = meta | {key: value}
    with pytest.raises(WeightsError) as e:
        tokenizer_config(bad, hf_config(bad, "float32"))
    assert key.rpartition(".")[2] in str(e.value) or "architecture" in str(e.value), str(e.value)


def test_the_default_model_reads_as_before(meta: dict[str, Any]) -> None:
    from tinypaged.weights.gguf_metadata import hf_config, tokenizer_config

    config = hf_config(meta, "float32")
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["head_dim"]) == (30, 9, 64)
    assert config["bos_token_id"] == 1 and config["eos_token_id"] == 2 and config["pad_token_id"] == 2
    assert tokenizer_config(meta, config)["eos_token"] == "<|im_end|>"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> bytes:
    """A sound 2-layer Llama GGUF (test_gguf_quant.py's), as bytes."""
    from test_gguf_quant import write_tiny_llama

    layer = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0"}
    layer |= {"ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q8_0"}
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_llama(path, gguf_path, [layer, layer])
    return path.read_bytes()


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("llama.block_count", 2**30, "block_count"),  # past the file's tensors: before a loop over layers
        ("llama.block_count", 1, r"'blk\.1\.\S+' is past the metadata's block_count"),  # a block it lacks
        ("llama.attention.head_count", 256, "rotary pairs"),  # q's 256 rows: not 256 heads of rotary pairs
        ("tokenizer.ggml.bos_token_id", 10**6, "bos_token_id"),
    ],
)
def test_a_hostile_file_converts_to_nothing(
    tmp_path: Path, tiny: bytes, key: str, value: int, match: str
) -> None:
    """The sound file with one 32-bit metadata value replaced (after its key: the value's type, then the value)."""
    import struct

    from tinypaged.weights import convert_gguf

    name = key.encode()
    at = tiny.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack_from("<I", tiny, at)[0] == gguf.GGUFValueType.UINT32
    path = tmp_path / "bad.gguf"
    path.write_bytes(tiny[: at + 4] + struct.pack("<I", value) + tiny[at + 8 :])
    with pytest.raises(WeightsError, match=match):
        convert_gguf(path, tmp_path / "out", keep_quantized=True)  # as `LLM(model="x.gguf")` converts
    assert not (tmp_path / "out").exists()
