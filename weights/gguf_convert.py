"""Convert a llama.cpp GGUF file of a model the engine runs into a Hugging Face-style model directory.

The output is what the engine's loader reads: `config.json`, `model.safetensors` (dequantized),
`tokenizer.json` (HF `tokenizers`), `tokenizer_config.json` (with the chat template) and
`generation_config.json`. With `keep_quantized`, the decoder's linear layers stay in their GGUF blocks, repacked
losslessly into the INT4 / INT8 layout (`gguf_quant.py`: `qweight`, `scales` and, for `q * d + m` types,
`mins`), and config.json says which type each layer has (`quantization_config`, `quant_method: gguf`); what
`LLM(model="x.gguf")` loads (`fetch.resolve_model`). The embedding, the LM head and the norms are dequantized
either way. Architectures "llama" (Llama, Mistral; Llama 3.1's RoPE scaling, which llama.cpp stores as a
`rope_freqs` tensor, back as config.json's `rope_scaling`), "qwen2", "qwen3" and "gemma3" (its text model); the
vocabularies (byte-level BPE, SentencePiece) are built in `gguf_tokenizer.py`, the metadata read, checked and
made config.json in `gguf_metadata.py`. Anything else ends with a `WeightsError` rather than a wrong model.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from .errors import WeightsError
from .gguf_metadata import (
    generation_config,
    hf_config,
    open_gguf,
    read_metadata,
    tokenizer_config,
)
from .gguf_tokenizer import build_tokenizer

_DTYPES = ("float32", "float16", "bfloat16")

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.bias": "self_attn.q_proj.bias",  # Qwen2
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3, Gemma 3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma 3 normalises after attention and around the MLP: its ffn_norm comes before the MLP.
_GEMMA3_TENSORS = _LAYER_TENSORS | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_REPACKED = (
    ".qweight",
    ".scales",
    ".mins",
    ".zeros",
)  # a linear layer kept in its GGUF blocks (`gguf_quant.py`)
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    dtype: str = "float32",
    keep_quantized: bool = False,
    vocabulary: bool = True,
) -> None:
    """Write the Hugging Face-style directory for the GGUF at `gguf_path` into `out_dir` (the linear layers
    dequantized to `dtype`, or kept in their blocks); without `vocabulary`, no tokenizer files (the engine is
    given a tokenizer of its own: its `tokenizer` argument)."""
    if dtype not in _DTYPES:
        raise WeightsError(f"unsupported dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    reader = open_gguf(Path(gguf_path))
    meta = read_metadata(reader)
    config = hf_config(meta, dtype)
    if config["num_hidden_layers"] > len(reader.tensors):  # before any loop over the layers
        raise WeightsError(
            f"GGUF metadata: block_count {config['num_hidden_layers']} but the file holds {len(reader.tensors)} "
            "tensors"
        )
    tensors, kinds = _hf_tensors(reader, config, keep_quantized)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    if kinds:
        config["quantization_config"] = {"quant_method": "gguf", "layers": kinds}
    try:  # everything is checked before the first file is written
        tokenizer = build_tokenizer(meta) if vocabulary else None
        tok_config = tokenizer_config(meta, config) if vocabulary else None
    except WeightsError as e:
        raise WeightsError(f"{gguf_path}: {e}") from e

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_safetensors(tensors, out_dir / "model.safetensors", dtype)
    if tokenizer is not None:
        tokenizer.save(str(out_dir / "tokenizer.json"))
        write_json(out_dir / "tokenizer_config.json", tok_config)
    write_json(out_dir / "generation_config.json", generation_config(config))
    write_json(out_dir / "config.json", config)


def llama3_rope_scaling(factors: np.ndarray, config: dict[str, Any]) -> dict[str, Any] | None:
    """Llama 3.1's RoPE scaling (config.json's `rope_type: llama3`) from a GGUF's `rope_freqs` tensor, which holds
    what llama.cpp divides each rotary frequency by: 1 for short wavelengths, `factor` for long ones, and between
    them `1 / ((1 - s) / factor + s)` with s falling linearly in 1 / wavelength. The band gives s's line (two
    points at least); it is written with low_freq_factor 1 (every such line has that form), and the factors it
    gives back are checked against the file's: a tensor that is not this scaling is refused. All ones: None."""
    dim, theta = int(config["head_dim"]), float(config["rope_theta"])
    f = factors.astype(np.float64).ravel()
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if f.shape != wavelen.shape or not np.all(np.isfinite(f)) or f.min() < 1.0 - 1e-6:
        raise WeightsError(f"rope_freqs.weight {list(factors.shape)} is not {dim // 2} factors of at least 1")
    factor = float(f.max())
    if factor <= 1.0 + 1e-6:
        return None  # every frequency as it is: no scaling
    s = (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor)
    band = (s > 1e-4) & (s < 1.0 - 1e-4)
    if band.sum() < 2:
        raise WeightsError(
            f"rope_freqs.weight interpolates {int(band.sum())} of its {f.size} frequencies: Llama 3's scaling "
            "cannot be recovered from fewer than two"
        )
    slope, intercept = np.polyfit(1.0 / wavelen[band], s[band], 1)  # s = old / (high - low) / wavelen - ...
    high, old = 1.0 - 1.0 / intercept, -slope / intercept  # ... low / (high - low), with low = 1
    if not (intercept < 0 and high > 1 and old > 0):
        raise WeightsError(
            "rope_freqs.weight is not Llama 3's frequency scaling (its band rises with wavelength)"
        )
    # The fit of float32 factors, rounded as config.json writes such values, where the rounding gives the same.
    for digits in (2, 4, None):
        h, o = (round(high, digits), round(old, digits)) if digits is not None else (high, old)
        smooth = np.clip((o / wavelen - 1.0) / (h - 1.0), 0.0, 1.0)
        if np.abs(1.0 / ((1.0 - smooth) / factor + smooth) / f - 1.0).max() <= 1e-5:
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": h,
                "original_max_position_embeddings": int(o) if float(o).is_integer() else o,
            }
    raise WeightsError(
        f"rope_freqs.weight is not Llama 3's frequency scaling (closest: factor {factor}, high_freq_factor "
        f"{high:.6g}, original_max_position_embeddings {old:.6g}, low_freq_factor 1)"
    )


def unpermute_rope_rows(weight: np.ndarray, n_head: int, name: str = "a Q or K projection") -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection weight of `n_head` heads.

    HF's RoPE rotates rows i and i + d/2 of each head together, llama.cpp's rows 2i and 2i + 1, so its
    converter interleaves the halves: reshape(n_head, 2, d/2, in) -> swap axes 1, 2. This is the inverse.
    """
    rows, cols = weight.shape
    if rows % (2 * n_head):
        raise WeightsError(
            f"{name} has {rows} rows: not {n_head} heads of rotary pairs (the metadata's count)"
        )
    return weight.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _hf_name(gguf_name: str, model_type: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    names = _GEMMA3_TENSORS if model_type == "gemma3_text" else _LAYER_TENSORS
    if prefix == "blk" and layer.isdigit() and suffix in names:
        return f"model.layers.{layer}.{names[suffix]}"
    return None


def _hf_tensors(
    reader: Any, config: dict[str, Any], keep_quantized: bool = False
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every tensor under its HF name, in HF's (out, in) layout: dequantized to float32, or (`keep_quantized`, a
    decoder linear layer's GGUF blocks) repacked as `<layer>.qweight`, `.scales` (and `.mins`); and the GGUF
    type of each layer kept quantized."""
    import gguf

    from .gguf_quant import one_layout_a_fused_layer, repack  # imports torch: not at `tinypaged --help`

    tensors: dict[str, np.ndarray] = {}
    kinds: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight" and config["model_type"] == "llama":
            config["rope_scaling"] = llama3_rope_scaling(np.asarray(tensor.data), config)
            continue
        name = _hf_name(tensor.name, config["model_type"])
        if name is None:
            # e.g. rope_freqs.weight (Llama 3 rope scaling): silently dropping it would change the model.
            raise WeightsError(f"unsupported GGUF tensor {tensor.name!r}")
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= config["num_hidden_layers"]:
            raise WeightsError(
                f"GGUF tensor {tensor.name!r} is past the metadata's block_count "
                f"({config['num_hidden_layers']} blocks)"
            )
        kind = tensor.tensor_type.name
        if keep_quantized and name.endswith("_proj.weight") and kind not in ("F32", "F16", "BF16"):
            rows, cols = (int(d) for d in reversed(tensor.shape.tolist()))
            tensors |= _repacked(name, repack(tensor.name, kind, tensor.data, rows, cols), config)
            kinds[name.removesuffix(".weight")] = kind
            shapes[name] = (rows, cols)
            continue
        try:
            # ggml lists dims fastest-first; the reader's array is already in numpy (row-major) order.
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            array = np.array(array, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))
        except (ValueError, NotImplementedError) as exc:
            raise WeightsError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {exc}") from exc
        # llama.cpp permutes Q and K rows for its "llama" architecture only; it stores Gemma's norm weights as
        # 1 + w, which HF's checkpoints (and the loader) take as w.
        if config["model_type"] == "llama" and name.endswith("q_proj.weight"):
            array = unpermute_rope_rows(array, config["num_attention_heads"], tensor.name)
        elif config["model_type"] == "llama" and name.endswith("k_proj.weight"):
            array = unpermute_rope_rows(array, config["num_key_value_heads"], tensor.name)
        elif config["model_type"] == "gemma3_text" and name.endswith("norm.weight"):
            array = array - 1.0
        tensors[name] = array
        shapes[name] = array.shape

    if keep_quantized:
        one_layout_a_fused_layer(tensors, kinds, config["num_hidden_layers"])
    expected = _expected_shapes(config, tied="lm_head.weight" not in tensors)
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise WeightsError(f"GGUF lacks {len(missing)} tensors, e.g. {missing[0]}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise WeightsError(f"{name} has shape {shapes[name]}, config implies {shape}")
    return tensors, kinds


def _repacked(name: str, w: Any, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """A repacked linear weight's tensors under the layer's name, Q and K rows un-permuted as dense ones are
    (a row permutation moves whole rows of codes and columns of scales: lossless)."""
    layer = name.removesuffix(".weight")
    parts = {"qweight": w.qweight.numpy(), "scales": w.scales.numpy().T}
    if w.mins is not None:
        parts["mins"] = w.mins.numpy().T
    heads = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads"}.get(layer.rpartition(".")[2])
    if config["model_type"] == "llama" and heads:
        parts = {k: unpermute_rope_rows(v, config[heads], name) for k, v in parts.items()}
    return {f"{layer}.{k}": np.ascontiguousarray(v if k == "qweight" else v.T) for k, v in parts.items()}


def _expected_shapes(config: dict[str, Any], tied: bool) -> dict[str, tuple[int, ...]]:
    hidden, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_dim = config["num_attention_heads"] * d
    kv_dim = config["num_key_value_heads"] * d
    family = config["model_type"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not tied:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
        if family == "qwen2":
            shapes |= {
                p + f"self_attn.{x}_proj.bias": (n,) for x, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))
            }
        if family in ("qwen3", "gemma3_text"):
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if family == "gemma3_text":
            shapes |= {p + f"{x}_feedforward_layernorm.weight": (hidden,) for x in ("pre", "post")}
    return shapes


def _save_safetensors(tensors: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    state = {  # the repacked layers' codes and float32 scales keep their dtypes
        name: (t if name.endswith(_REPACKED) else t.to(torch_dtype)).contiguous()
        for name, t in ((name, torch.from_numpy(a)) for name, a in tensors.items())
    }
    save_file(state, str(path), metadata={"format": "pt"})
    # safetensors writes through a private temporary file (mode 0600); give it the usual permissions.
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """A model directory's JSON file: indented, UTF-8, newline-terminated."""
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
