"""What a GGUF file's metadata says, read and checked: the reader opened on the file, every value decoded, the
counts, sizes, numbers and token ids a conversion relies on each checked where it is read (one `WeightsError`
naming the key for a damaged or hostile value: never a division by zero, a loop over 2^40 layers or a token id
out of the vocabulary), and the Hugging Face JSON files the metadata implies (config.json,
tokenizer_config.json, generation_config.json). `gguf_convert.py` converts the tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tinypaged.config_json import finite, is_size

from .errors import WeightsError
from .gguf_tokenizer import TOKEN_CONTROL, TOKEN_USER_DEFINED

# GGUF architecture -> (HF architecture, model_type).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}


def open_gguf(path: Path) -> Any:
    """`gguf`'s reader on the file: one WeightsError where the package, the file or its header is missing or
    damaged."""
    try:
        import gguf
    except ImportError as exc:
        raise WeightsError("the `gguf` package is needed to convert GGUF files: pip install gguf") from exc
    if not path.is_file():
        raise WeightsError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises whatever numpy/struct hit on a damaged file
        raise WeightsError(f"{path}: truncated or not a GGUF file ({type(exc).__name__}: {exc})") from exc


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata value but the reader's own (`GGUF.*`), decoded: key -> value."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:  # the reader decodes values only here: a damaged string is not UTF-8
            meta[key] = field.contents()
        except Exception as exc:
            path = getattr(reader.data, "filename", "the GGUF file")  # the reader's np.memmap
            raise WeightsError(
                f"{path}: truncated or not a GGUF file (metadata {key!r}: {type(exc).__name__}: {exc})"
            ) from exc
    return meta


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise WeightsError(f"GGUF metadata lacks {key!r}")
    return meta[key]


def _size(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    """A count or dimension of the metadata: an integer from 1 to 2^31 - 1 (config.json's rule), else one
    WeightsError naming it. A damaged or hostile file's 0 or 2^40 never reaches a division or a loop."""
    value = _require(meta, key) if default is None else meta.get(key, default)
    if not is_size(value):
        raise WeightsError(f"GGUF metadata {key!r} is {value!r}: not a size from 1 to 2^31 - 1")
    return value


def _number(meta: dict[str, Any], key: str, default: float | None = None, positive: bool = False) -> float:
    """A finite real of the metadata (> 0 where `positive`, else >= 0), else one WeightsError naming it."""
    value = _require(meta, key) if default is None else meta.get(key, default)
    if not finite(value) or value < 0 or (positive and value == 0):
        rule = "a positive number" if positive else "a number >= 0"
        raise WeightsError(f"GGUF metadata {key!r} is {value!r}: not {rule}")
    return float(value)


def _token_id(meta: dict[str, Any], key: str) -> int | None:
    """`tokenizer.ggml.<key>`, a token id of the vocabulary (None where absent), else one WeightsError naming it."""
    value = meta.get(f"tokenizer.ggml.{key}")
    tokens = meta.get("tokenizer.ggml.tokens")
    tokens = tokens if isinstance(tokens, list) else []
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens)
    ):
        raise WeightsError(
            f"GGUF metadata 'tokenizer.ggml.{key}' is {value!r}: not a token id (0 to {len(tokens) - 1})"
        )
    return value


def _token(meta: dict[str, Any], key: str) -> str | None:
    token_id = _token_id(meta, key)
    return None if token_id is None else meta["tokenizer.ggml.tokens"][token_id]


def hf_config(meta: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json of the model the metadata describes, weights in `dtype` (`tie_word_embeddings` and the
    quantization are settled by the converter once the tensors are read)."""
    arch = _require(meta, "general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise WeightsError(
            f"unsupported GGUF architecture {arch!r} (converted: {', '.join(ARCHITECTURES)}: Llama, Mistral, "
            "Qwen2/2.5, Qwen3, Gemma 3)"
        )
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) and not (arch == "gemma3" and scaling == "linear"):
        raise WeightsError(f"GGUF files with {scaling!r} RoPE scaling are not supported by this converter")

    hidden = _size(meta, f"{arch}.embedding_length")
    n_head = _size(meta, f"{arch}.attention.head_count")
    if f"{arch}.attention.key_length" not in meta and hidden % n_head:
        raise WeightsError(
            f"GGUF metadata: embedding_length {hidden} is not a multiple of head_count {n_head}"
        )
    head_dim = _size(meta, f"{arch}.attention.key_length", hidden // n_head)
    rope_dim = _size(meta, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise WeightsError(f"partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported")
    tokens = _require(meta, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise WeightsError("GGUF metadata 'tokenizer.ggml.tokens' is not a list of tokens")
    hf_arch, model_type = ARCHITECTURES[arch]
    family: dict[str, Any] = {}
    if arch == "gemma3":
        # llama.cpp's Gemma 3: windowed layers five in six, their rope base 10000, q scaled by head_dim^-0.5.
        family = {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": head_dim,
            "sliding_window": _size(meta, f"{arch}.attention.sliding_window"),
            "sliding_window_pattern": 6,
            "rope_local_base_freq": 10000.0,
        }
        if scaling == "linear":
            family["rope_scaling"] = {
                "rope_type": "linear",
                "factor": _number(meta, f"{arch}.rope.scaling.factor", positive=True),
            }
    return {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": _size(meta, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _size(meta, f"{arch}.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": _size(meta, f"{arch}.attention.head_count_kv", n_head),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _number(meta, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": _number(meta, f"{arch}.rope.freq_base", 10000.0, positive=True),
        "max_position_embeddings": _size(meta, f"{arch}.context_length"),
        "vocab_size": _size(meta, f"{arch}.vocab_size", len(tokens)),
        "tie_word_embeddings": True,  # settled once the tensors are known
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _token_id(meta, "bos_token_id"),
        "eos_token_id": _eos_ids(meta),
        "pad_token_id": _token_id(meta, "padding_token_id"),
        "torch_dtype": dtype,
        **family,
    }


def _eos_ids(meta: dict[str, Any]) -> int | list[int] | None:
    """The ids that end a generation: the GGUF's EOS, and its end-of-turn and end-of-message tokens where it
    names them (Llama 3.1's `<|eot_id|>` and `<|eom_id|>`, as its own config.json lists them beside EOS)."""
    found = [_token_id(meta, f"{kind}_token_id") for kind in ("eos", "eot", "eom")]
    ids = list(dict.fromkeys(i for i in found if i is not None))
    return ids[0] if len(ids) == 1 else ids or None


def tokenizer_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: the special and added tokens, the BOS / EOS flags, the chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []
    added = {
        str(i): {
            "content": tokens[i],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": kind == TOKEN_CONTROL,
        }
        for i, kind in enumerate(types)
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    }
    result: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    for name, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unknown_token_id"),
        ("pad", "padding_token_id"),
    ):
        token = _token(meta, key)
        if token is not None:
            result[f"{name}_token"] = token
    if "tokenizer.chat_template" in meta:
        result["chat_template"] = meta["tokenizer.chat_template"]
    return result


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: the BOS, EOS (and pad) ids of `config`."""
    result = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    if config.get("pad_token_id") is not None:
        result["pad_token_id"] = config["pad_token_id"]
    return result
