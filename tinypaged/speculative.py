"""Speculative decoding's configuration, vLLM's `speculative_config`: checked once, at start, with no torch.

`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}` proposes
the k tokens that followed the latest earlier occurrence of the sequence's last a..b tokens (prompt lookup);
`{"method": "draft_model", "model": DIR}` runs a smaller model of the same vocabulary as the draft, and with no
model and `"quantization": "int4"` the target itself quantized (its own low-bit copy). `disable_by_batch_size`:
no speculation in a step once more requests than this are running or waiting. `"method": "oracle"` is for
benchmarks only (docs/speculative.md): it proposes the target's own greedy continuation, each token right with
probability `acceptance_rate`, at no cost; with `draft_model`, `oracle_acceptance_rate` replaces the draft's
proposals the same way while keeping its cost.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tinypaged.errors import ConfigError
from tinypaged.quantization import canonical_quantization

METHODS = ("ngram", "draft_model", "oracle")
MAX_SPECULATIVE_TOKENS = 16
_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "quantization",
    "disable_by_batch_size",
    "acceptance_rate",
    "oracle_acceptance_rate",
}


class _Engine(Protocol):
    """The engine arguments speculation is checked against (EngineConfig's)."""

    max_num_batched_tokens: int
    kv_reservation: str
    tensor_parallel_size: int


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates: the proposer (`method`), how many tokens it proposes a step, its settings."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: Path | None = None  # draft_model: the draft's directory; None: the target's own low-bit copy
    quantization: str | None = (
        None  # draft_model: quantize the draft at load (int4: the target's low-bit copy)
    )
    disable_by_batch_size: int | None = None
    acceptance_rate: float = 0.8  # oracle: the chance each proposed token is the target's own
    oracle_acceptance_rate: float | None = (
        None  # draft_model benchmarks: replace its proposals as the oracle's
    )

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | str) -> SpeculativeConfig:
        """Check vLLM's `speculative_config` dict (or its JSON text); ConfigError naming the bad key."""
        if isinstance(raw, str):
            import json

            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"speculative_config must be a dict, got {type(raw).__name__}")
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key {unknown[0]!r}; the keys are {sorted(_KEYS)}")
        method = raw.get("method")
        if method is None:
            method = "draft_model" if raw.get("model") is not None else "ngram"
        if method not in METHODS:
            raise ConfigError(f"speculative_config: unknown method {method!r}; one of {', '.join(METHODS)}")
        k = raw.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"speculative_config: num_speculative_tokens must be an int in 1..{MAX_SPECULATIVE_TOKENS}, "
                f"got {k!r}"
            )
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        # vLLM's defaults: 5 and 5, or the one given for both.
        lo, hi = (lo if lo is not None else (hi or 5)), (hi if hi is not None else (lo or 5))
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ConfigError(
                f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r}, {hi!r}"
            )
        disable = raw.get("disable_by_batch_size")
        if disable is not None and (not isinstance(disable, int) or disable < 1):
            raise ConfigError(
                f"speculative_config: disable_by_batch_size must be an int >= 1, got {disable!r}"
            )
        quant = raw.get("quantization")
        model = raw.get("model")
        if method == "draft_model":
            if model is None and quant is None:
                raise ConfigError(
                    "speculative_config: draft_model needs a model directory, or a quantization "
                    "(e.g. int4: the target's own low-bit copy)"
                )
            if model is not None and not Path(model).is_dir():
                raise ConfigError(f"speculative_config: draft model directory not found: {model}")
        elif model is not None or quant is not None:
            raise ConfigError(f"speculative_config: model and quantization are for draft_model, not {method}")
        rates = {"acceptance_rate": raw.get("acceptance_rate", 0.8)}
        if raw.get("oracle_acceptance_rate") is not None:
            rates["oracle_acceptance_rate"] = raw["oracle_acceptance_rate"]
        for name, rate in rates.items():
            if not isinstance(rate, int | float) or not 0.0 <= rate <= 1.0:
                raise ConfigError(f"speculative_config: {name} must be in [0, 1], got {rate!r}")
        return cls(
            method=method,
            num_speculative_tokens=k,
            prompt_lookup_min=lo,
            prompt_lookup_max=hi,
            model=Path(model) if model is not None else None,
            quantization=canonical_quantization(quant) if isinstance(quant, str) else quant,
            disable_by_batch_size=disable,
            acceptance_rate=float(rates["acceptance_rate"]),
            oracle_acceptance_rate=rates.get("oracle_acceptance_rate"),
        )

    def check_engine(
        self, engine: _Engine, quantizations: Collection[str], vocab_sizes: tuple[int, int | None]
    ) -> None:
        """Checked against the engine it runs in (its EngineConfig): a step that holds k + 1 tokens, paged KV
        blocks (rejected tokens' slots go back block by block), one rank, a draft of the target's vocabulary
        (`vocab_sizes`: the target's, the draft model's or None)."""
        k = self.num_speculative_tokens
        max_num_batched_tokens = engine.max_num_batched_tokens
        kv_reservation, tensor_parallel_size = engine.kv_reservation, engine.tensor_parallel_size
        if k + 1 > max_num_batched_tokens:
            raise ConfigError(
                f"speculative_config: num_speculative_tokens {k} + 1 exceeds "
                f"max_num_batched_tokens={max_num_batched_tokens}"
            )
        if kv_reservation != "paged":
            raise ConfigError(
                "speculative_config needs kv_reservation='paged' (rejected slots go back by block)"
            )
        if tensor_parallel_size > 1:
            raise ConfigError(
                "speculative_config is not run under tensor parallelism (tensor_parallel_size > 1)"
            )
        if self.quantization is not None and self.quantization not in quantizations:
            raise ConfigError(
                f"speculative_config: quantization must be one of {', '.join(quantizations)}; "
                f"got {self.quantization!r}"
            )
        target, draft = vocab_sizes
        if draft is not None and draft != target:
            raise ConfigError(
                f"speculative_config: the draft model's vocabulary ({draft} tokens, {self.model}) differs from "
                f"the target's ({target})"
            )
