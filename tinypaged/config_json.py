"""What a model's config.json values mean beyond their names, and which of them the engine refuses: each
layer's attention window (`layer_windows`), and the checks that turn a value the engine cannot run (a damaged or
hand-edited file: a negative size, a rotary setting that gives NaN angles) into one ConfigError line before
anything is allocated (`check_values`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

from tinypaged.errors import ConfigError


class ModelValues(Protocol):
    """The fields of a `ModelConfig` (tinypaged/config.py, which imports this module) that the checks read."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None


def check_values(cfg: ModelValues, path: Path) -> None:
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
        if not 0 < size < 2**31:
            raise ConfigError(f"bad config.json in {path}: {name} {size} is not a size from 1 to 2^31 - 1")
    if cfg.head_dim % 2:
        raise ConfigError(f"bad config.json in {path}: head_dim {cfg.head_dim} is odd (rotary takes pairs)")
    _check_rope(cfg, path)


def _finite(v: Any) -> bool:
    """Whether v is a finite JSON number (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_rope(cfg: ModelValues, path: Path) -> None:
    """ConfigError where the rotary settings (or the norm's eps) would give NaNs, or fail where they are used."""
    if not (_finite(cfg.rope_theta) and cfg.rope_theta > 0):
        raise ConfigError(f"bad config.json in {path}: rope_theta {cfg.rope_theta} is not a positive number")
    if not (_finite(cfg.rms_norm_eps) and cfg.rms_norm_eps >= 0):
        raise ConfigError(f"bad config.json in {path}: rms_norm_eps {cfg.rms_norm_eps} is not a number >= 0")
    scaling = cfg.rope_scaling
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ConfigError(f"bad config.json in {path}: rope_scaling {scaling!r} is not an object")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("linear", "llama3") and not (_finite(scaling.get("factor")) and scaling["factor"] > 0):
        raise ConfigError(f"bad config.json in {path}: rope_scaling {scaling} needs a positive factor")
    if kind == "llama3":
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        if not (_finite(low) and _finite(high) and high > low and _finite(old_ctx) and old_ctx > 0):
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
