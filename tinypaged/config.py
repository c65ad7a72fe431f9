"""Configuration: the model's shape (from config.json) and the engine's knobs (vLLM's names and meanings)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
SUPPORTED_MODEL_TYPES = ("llama", "mistral")


logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A model directory or an engine argument that cannot be used; the message says why."""


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family model, read from its config.json."""

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
    sliding_window: int | None = None  # Mistral v0.1: each token attends to this many tokens at most

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
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES and not set(archs) & set(SUPPORTED_ARCHITECTURES):
            got = model_type or (archs[0] if archs else "unknown")
            raise ConfigError(
                f"unsupported model architecture {got!r} in {path}: tinypaged serves Llama-family models "
                f"({', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            # transformers >= 5 writes rope settings as one `rope_parameters` dict; checkpoints in the wild
            # carry `rope_theta` and `rope_scaling`.
            rope = raw.get("rope_parameters") or {}
            rope_scaling = raw.get("rope_scaling") or (
                rope if rope.get("rope_type", "default") != "default" else None
            )
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
                attention_bias=bool(raw.get("attention_bias", False)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                sliding_window=int(raw["sliding_window"]) if raw.get("sliding_window") else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"bad config.json in {path}: {type(e).__name__}: {e}") from e
        if cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError(f"num_attention_heads {cfg.num_heads} is not a multiple of {cfg.num_kv_heads}")
        if cfg.rope_scaling and cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) not in (
            "llama3",
            "default",
        ):
            raise ConfigError(f"unsupported rope_scaling {cfg.rope_scaling} in {path}")
        return cfg


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, how many blocks, swap space."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out blocks
    enable_prefix_caching: bool = False
    # On the CPU the "GPU" cache lives in host memory too: size it from this many GiB when not overridden.
    cpu_kv_cache_space: float = 1.0

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ConfigError(f"block_size must be a power of two from 1 to 128, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.swap_space < 0:
            raise ConfigError(f"swap_space must be >= 0 GiB, got {self.swap_space}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, passed whole to its parts."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    preemption_mode: Literal["recompute", "swap"] | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    enforce_eager: bool = False  # True: no CUDA graphs for decode batches
    # Queue each step before applying the previous step's tokens, so host work overlaps the device (None: on
    # for a GPU, where it pays; off on the CPU, where the host is the device).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        limit, window = self.model.max_position_embeddings, self.model.sliding_window
        # The attention here is over the whole context, which equals a sliding-window model's attention only
        # while the context fits in the window: such a model is served up to its window.
        windowed = window is not None and window < limit
        if windowed:
            limit = window
        if self.max_model_len <= 0:
            if windowed:
                logger.warning("max_model_len capped at the model's sliding window (%d tokens)", window)
            object.__setattr__(self, "max_model_len", limit)
        elif self.max_model_len > limit:
            what = "sliding window" if windowed else "context"
            raise ConfigError(
                f"max_model_len {self.max_model_len} exceeds the model's {what} ({limit} tokens)"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ConfigError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ConfigError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")

    @classmethod
    def from_engine_args(cls, model: str | Path, **engine_args: Any) -> EngineConfig:
        """Build from vLLM-style flat engine arguments (what `LLM(...)` and the CLI take)."""
        cache_keys = {f.name for f in fields(CacheConfig)} & engine_args.keys()
        cache = CacheConfig(**{k: engine_args.pop(k) for k in cache_keys})
        engine_args["max_model_len"] = engine_args.get("max_model_len") or 0
        return cls(model=ModelConfig.from_dir(model), cache=cache, **engine_args)

    @property
    def max_blocks_per_seq(self) -> int:
        """Columns of a block table: enough blocks for a sequence of max_model_len tokens."""
        return math.ceil(self.max_model_len / self.cache.block_size)
