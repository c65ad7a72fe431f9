"""Random-weight model directories: a synthetic tokenizer (when the vocabulary is not the default model's) comes
with a chat template, so that such models serve the chat API in load tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinypaged.config import ModelConfig
from tinypaged.model import load_model
from tinypaged.tokenizer import Tokenizer
from tinypaged.weights.random_model import PRESETS, make_random_model


def test_synthetic_tokenizer_has_a_chat_template(tmp_path: Path) -> None:
    out = make_random_model(
        "smollm2-135m", tmp_path / "m", overrides={"vocab_size": 1000, "num_hidden_layers": 1}
    )
    tok = Tokenizer(out)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n"
    assert tok.decode(tok.encode(text, False), False) == text


@pytest.mark.parametrize("preset", ["qwen2.5-7b", "qwen3-8b", "mistral-7b", "gemma-3-4b", "gemma-3-12b"])
def test_family_presets_load(tmp_path: Path, preset: str) -> None:
    """Each family's benchmark shape, scaled down, writes every tensor its family reads (biases, q/k norms,
    Gemma's four norms a layer) and nothing else, with the family's settings (windows, rope) in config.json."""
    small = {"vocab_size": 1000, "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96}
    small |= {"head_dim": 16, "sliding_window_pattern": 2}
    out = make_random_model(preset, tmp_path / preset, overrides=small)
    cfg = ModelConfig.from_dir(out)
    assert cfg.family == PRESETS[preset]["model_type"].removesuffix("_text")
    if preset == "mistral-7b":
        assert cfg.layer_windows == (4096, 4096)
    elif preset.startswith("gemma"):
        assert cfg.layer_windows == (1024, None) and cfg.rope_scaling == {
            "rope_type": "linear",
            "factor": 8.0,
        }
    else:
        assert cfg.layer_windows == ()
    model = load_model(cfg, torch.float32, torch.device("cpu"), 64)
    assert torch.isfinite(model.compute_logits(model.embed_tokens.weight[:2])).all()
