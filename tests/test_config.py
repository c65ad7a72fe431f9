"""Model and engine configuration: what config.json gives, and the limits an engine config is held to."""

from __future__ import annotations

from pathlib import Path

import pytest

from tinypaged.config import ConfigError, EngineConfig, ModelConfig

MISTRAL = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 211,
    "max_position_embeddings": 32768,
}


def _model(**overrides: object) -> ModelConfig:
    return ModelConfig.from_dict(Path("m"), MISTRAL | overrides)


def test_sliding_window_caps_the_default_length() -> None:
    cfg = EngineConfig(model=_model(sliding_window=4096))
    assert cfg.model.sliding_window == 4096 and cfg.max_model_len == 4096
    assert EngineConfig(model=_model(sliding_window=4096), max_model_len=1000).max_model_len == 1000


def test_sliding_window_refuses_a_longer_context() -> None:
    with pytest.raises(ConfigError, match=r"exceeds the model's sliding window \(4096 tokens\)"):
        EngineConfig(model=_model(sliding_window=4096), max_model_len=8192)


@pytest.mark.parametrize("window", [None, 0, 32768, 65536])
def test_no_window_or_one_past_the_context(window: int | None) -> None:
    # Mistral v0.2+ writes null; a window at least as long as the context never binds.
    cfg = EngineConfig(model=_model(sliding_window=window))
    assert cfg.max_model_len == 32768
    with pytest.raises(ConfigError, match=r"exceeds the model's context \(32768 tokens\)"):
        EngineConfig(model=_model(sliding_window=window), max_model_len=40000)
