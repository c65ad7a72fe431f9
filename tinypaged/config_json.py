"""A model's config.json read into `ModelConfig` (its shape, and where its family differs from Llama): what the
values mean beyond their names, each layer's attention window (`layer_windows`), and the checks that turn a value
the engine cannot run (a damaged or hand-edited file: a negative size, a rotary setting that gives NaN angles)
into one ConfigError line before anything is allocated (`check_values`). `tinypaged.config` re-exports
`ModelConfig` beside `EngineConfig`, which reads it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinypaged.errors import ConfigError

# config.json's model_type -> the family the model code runs it as (its switches: tinypaged/model/llama.py).
FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
}
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
SUPPORTED_FAMILIES = "Llama, Mistral, Qwen2/2.5, Qwen3 and Gemma 3 text"


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a model of one of the families the Llama module runs, read from its config.json; the fields
    after `torch_dtype` are where the families differ from Llama."""

    path: Path
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    family: str = "llama"  # FAMILIES' values
    # The window of each layer (None: it attends to the whole context): a token sees itself and the window - 1
    # tokens before it. Empty: no layer is windowed.
    layer_windows: tuple[int | None, ...] = ()
    qkv_bias: bool = False  # Qwen2: biases on q, k and v but not o (`attention_bias`: on all four)
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head of q and k, before the rotary embedding
    hidden_act: str = "silu"  # the gate's activation: silu, or gelu_pytorch_tanh (Gemma 3)
    # Gemma 3's windowed layers rotate with their own base (`rope_local_base_freq`), unscaled.
    local_rope_theta: float | None = None
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # config.json's `quantization_config` as written (model/quant/scheme.py reads it); None: full precision
    quantization_config: dict[str, Any] | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read and check `path/config.json`."""
        path = Path(path)
        if not path.is_dir():
            raise ConfigError(f"model directory not found: {path}")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"no config.json in model directory {path}")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_file} is not valid JSON: {e}") from e
        return cls.from_dict(path, raw)

    @classmethod
    def from_dict(cls, path: Path, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed config.json, rejecting architectures this engine does not implement."""
        listed = raw.get("architectures")
        archs = [a for a in listed if isinstance(a, str)] if isinstance(listed, list) else []
        model_type = raw.get("model_type") if isinstance(raw.get("model_type"), str) else None
        arch_type = {a: t for t, a in zip(FAMILIES, SUPPORTED_ARCHITECTURES, strict=True)}
        family = FAMILIES.get(model_type) or next(
            (FAMILIES[arch_type[a]] for a in archs if a in arch_type), None
        )
        if family is None:
            got = model_type or (archs[0] if archs else "unknown")
            raise ConfigError(
                f"unsupported model architecture {got!r} in {path}: tinypaged runs {SUPPORTED_FAMILIES} "
                f"({', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            # transformers >= 5 writes rope settings as one `rope_parameters` dict; checkpoints in the wild
            # carry `rope_theta` and `rope_scaling`.
            rope = raw.get("rope_parameters") or {}
            # Gemma 3 under transformers >= 5: one dict per layer type.
            local_rope = rope.get("sliding_attention") or {}
            rope = rope.get("full_attention", rope)
            rope_scaling = raw.get("rope_scaling") or (
                rope if rope.get("rope_type", "default") != "default" else None
            )
            gemma = family == "gemma3"
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            cfg = cls(
                path=path,
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                vocab_size=int(raw["vocab_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta", 10000.0)),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)) and family != "qwen2",
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                quantization_config=raw.get("quantization_config"),
                family=family,
                layer_windows=layer_windows(family, raw),
                qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
                qk_norm=family in ("qwen3", "gemma3"),
                hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu"),
                local_rope_theta=float(
                    local_rope.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0
                )
                if gemma
                else None,
                attn_scale=float(raw.get("query_pre_attn_scalar") or 256) ** -0.5 if gemma else None,
                final_logit_softcapping=raw.get("final_logit_softcapping"),
            )
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError) as e:
            raise ConfigError(f"bad config.json in {path}: {type(e).__name__}: {e}") from e
        check_values(cfg, path)
        if cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError(f"num_attention_heads {cfg.num_heads} is not a multiple of {cfg.num_kv_heads}")
        if cfg.rope_scaling and cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) not in (
            "llama3",
            "linear",
            "default",
        ):
            raise ConfigError(f"unsupported rope_scaling {cfg.rope_scaling} in {path}")
        if local_rope.get("rope_type", "default") != "default":
            raise ConfigError(f"unsupported rope_parameters of the windowed layers {local_rope} in {path}")
        if cfg.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ConfigError(
                f"unsupported activation {cfg.hidden_act!r} in {path} (silu, gelu_pytorch_tanh)"
            )
        if raw.get("attn_logit_softcapping"):
            raise ConfigError(f"attention logit softcapping (attn_logit_softcapping) is not run ({path})")
        return cfg

    @property
    def sliding_window(self) -> int | None:
        """The longest layer window (None: no layer is windowed)."""
        return max((w for w in self.layer_windows if w is not None), default=None)

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has one (the block manager then gives back the blocks it has passed);
        None when some layer sees the whole context."""
        windowed = self.layer_windows and all(w is not None for w in self.layer_windows)
        return self.sliding_window if windowed else None

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s window (None: the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else None


def check_values(cfg: ModelConfig, path: Path) -> None:
    """ConfigError naming the first value of a parsed config.json (`cfg`, read from `path`) that the engine cannot
    run: a size outside 1 to 2^31 - 1 (tensor dimensions and kernel indices are 32-bit), an odd head_dim (the
    rotary takes pairs), rotary settings that cannot run."""
    sizes = {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
    }
    for name, size in sizes.items():
        if not is_size(size):
            raise ConfigError(f"bad config.json in {path}: {name} {size} is not a size from 1 to 2^31 - 1")
    if cfg.head_dim % 2:
        raise ConfigError(f"bad config.json in {path}: head_dim {cfg.head_dim} is odd (rotary takes pairs)")
    _check_rope(cfg, path)


def finite(v: Any) -> bool:
    """Whether v is a finite JSON number (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_size(v: Any) -> bool:
    """Whether v is a size the engine can run: an integer (not a bool) from 1 to 2^31 - 1 (tensor dimensions and
    kernel indices are 32-bit)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2**31


def _check_rope(cfg: ModelConfig, path: Path) -> None:
    """ConfigError where the rotary settings (or the norm's eps) would give NaNs, or fail where they are used."""
    if not (finite(cfg.rope_theta) and cfg.rope_theta > 0):
        raise ConfigError(f"bad config.json in {path}: rope_theta {cfg.rope_theta} is not a positive number")
    if not (finite(cfg.rms_norm_eps) and cfg.rms_norm_eps >= 0):
        raise ConfigError(f"bad config.json in {path}: rms_norm_eps {cfg.rms_norm_eps} is not a number >= 0")
    scaling = cfg.rope_scaling
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ConfigError(f"bad config.json in {path}: rope_scaling {scaling!r} is not an object")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("linear", "llama3") and not (finite(scaling.get("factor")) and scaling["factor"] > 0):
        raise ConfigError(f"bad config.json in {path}: rope_scaling {scaling} needs a positive factor")
    if kind == "llama3":
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        if not (finite(low) and finite(high) and high > low and finite(old_ctx) and old_ctx > 0):
            raise ConfigError(
                f"bad config.json in {path}: rope_scaling {scaling} needs high_freq_factor > low_freq_factor "
                "and a positive original_max_position_embeddings"
            )


def layer_windows(family: str, raw: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's window from config.json: `layer_types` where it is written, else the family's rule (Mistral:
    every layer; Qwen: none unless `use_sliding_window`, then the layers from `max_window_layers` on; Gemma 3:
    all but every `sliding_window_pattern`-th). A window of 0 or null is none."""
    window = raw.get("sliding_window")
    n = int(raw["num_hidden_layers"])
    if (
        not window
        or (family in ("qwen2", "qwen3") and not raw.get("use_sliding_window"))
        or family == "llama"
    ):
        return ()
    types = raw.get("layer_types")
    if types is None:
        if family == "mistral":
            types = ["sliding_attention"] * n
        elif family == "gemma3":
            pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        else:
            start = int(raw.get("max_window_layers", n))
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types {types} is not one of sliding_attention/full_attention a layer")
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    return windows if any(windows) else ()
