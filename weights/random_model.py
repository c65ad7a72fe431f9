"""Random-weight model directories with real shapes, in the normal format, so that benchmarks run the real
loader.

`make_random_model("llama-3.1-8b", out)` writes config.json, generation_config.json, safetensors weights
(bf16, sharded with a `model.safetensors.index.json` when larger than one shard) and a tokenizer. Weights are
drawn tensor by tensor (on a GPU when there is one) and written shard by shard, so host memory holds at most
one shard. Linear and embedding weights are normal with std 0.02, norm weights 1: logits stay finite and
O(1) through every layer.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

from .fetch import default_model_dir
from .gguf_convert import write_json

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_QWEN = {"rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "use_sliding_window": False}
_QWEN |= {"bos_token_id": 151643, "eos_token_id": 151645}
_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_activation": "gelu_pytorch_tanh",
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "vocab_size": 262208,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
}

# Shapes of the public configs (config.json of each model), for benchmarks with random weights; Llama's unless
# `architectures` says otherwise.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2.5-7b": {
        **_QWEN,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "sliding_window": 131072,
        "max_window_layers": 28,
    },
    "qwen3-8b": {
        **_QWEN,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
    },
    # Mistral-7B v0.1: the one with a sliding window (4096) on every layer; v0.2 and v0.3 have none.
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # Gemma 3's text models: five windowed layers (1024) to each global one.
    "gemma-3-4b": {
        **_GEMMA3,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "gemma-3-12b": {
        **_GEMMA3,
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    },
}

_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
SHARD_BYTES = 5 * 1024**3  # as HF writes them: at most ~5 GB per file
WEIGHT_STD = 0.02


def make_random_model(
    preset: str, out_dir: str | Path, seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """Write the model directory of `preset` (a key of PRESETS; `overrides` change config fields)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown config {preset!r}; choose from {', '.join(PRESETS)}")
    cfg = {**PRESETS[preset], **(overrides or {})}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        **cfg,
    }
    write_json(out / "config.json", config)
    write_json(
        out / "generation_config.json",
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]},
    )
    _write_weights(cfg, out, seed)
    _write_tokenizer(cfg, out)
    return out


def _tensor_shapes(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Checkpoint names and shapes, in HF's order (embeddings, layers, final norm, head), with each family's
    extra tensors: Qwen2's q/k/v biases, Qwen3's and Gemma 3's per-head q/k norms, Gemma 3's norms after the
    attention and around the MLP."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    family = cfg.get("model_type", "llama")
    shapes = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
        if family == "qwen2":
            shapes += [(p + f"self_attn.{x}_proj.bias", (n,)) for x, n in (("q", q), ("k", kv), ("v", kv))]
        if family in ("qwen3", "gemma3_text"):
            shapes += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
        if family == "gemma3_text":
            shapes += [
                (p + "pre_feedforward_layernorm.weight", (h,)),
                (p + "post_feedforward_layernorm.weight", (h,)),
            ]
    shapes.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (cfg["vocab_size"], h)))
    return shapes


def _write_weights(cfg: dict[str, Any], out: Path, seed: int) -> None:
    # Imported here, not at the top: `tinypaged --help` lists PRESETS and must stay free of torch.
    import torch
    from safetensors.torch import save_file

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    # Plan the shards first (greedy, in checkpoint order), so that file names carry the shard count.
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in _tensor_shapes(cfg):
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = (
            "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {}
        for name, shape in shard:
            if name.endswith("norm.weight"):
                # Gemma's norms scale by 1 + w: zeros are its ones.
                one = 0.0 if cfg.get("model_type") == "gemma3_text" else 1.0
                tensors[name] = torch.full(shape, one, dtype=torch.bfloat16)
            else:
                t = torch.empty(shape, dtype=torch.float32, device=device).normal_(
                    0.0, WEIGHT_STD, generator=gen
                )
                tensors[name] = t.to(torch.bfloat16).cpu()
            weight_map[name] = fname
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        os.chmod(out / fname, 0o644)  # safetensors creates files 0600
        del tensors
    if len(shards) > 1:
        total = sum(2 * math.prod(shape) for shard in shards for _, shape in shard)
        write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )


def _write_tokenizer(cfg: dict[str, Any], out: Path) -> None:
    """The default model's tokenizer when its vocabulary has the config's size, else a synthetic one."""
    src = default_model_dir()
    if (src / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        if Tokenizer.from_file(str(src / "tokenizer.json")).get_vocab_size(True) == cfg["vocab_size"]:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(src / name, out / name)
            return
    _synthetic_tokenizer(cfg, out)


def _synthetic_tokenizer(cfg: dict[str, Any], out: Path) -> None:
    """A byte-level BPE over the config's whole vocabulary, so that every id decodes.

    Ids below 256 are the bytes; the others are distinct ASCII words (so random ids decode to whole
    characters and the incremental detokenizer never waits on a partial one); bos/eos are special tokens.
    There are no merges: text encodes to byte tokens, which is all a random-weight model needs.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab_size = cfg["vocab_size"]
    vocab = {c: i for i, c in enumerate(_byte_chars())}
    specials = {cfg["bos_token_id"]: "<|begin_of_text|>", cfg["eos_token_id"]: "<|end_of_text|>"}
    for i in range(len(vocab), vocab_size):
        vocab[specials.get(i, f"w{i:x}")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials.values()])
    tok.save(str(out / "tokenizer.json"))
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": specials[cfg["bos_token_id"]],
            "eos_token": specials[cfg["eos_token_id"]],
            # A plain role-tagged template, so that random models serve the chat API too (load tests).
            "chat_template": _CHAT_TEMPLATE,
        },
    )


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table, which tokenizers' ByteLevel uses, indexed by byte."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars
