"""Random-weight model directories: a synthetic tokenizer (when the vocabulary is not the default model's) comes
with a chat template, so that such models serve the chat API in load tests."""

from __future__ import annotations

from pathlib import Path

from tinypaged.tokenizer import Tokenizer
from tinypaged.weights.random_model import make_random_model


def test_synthetic_tokenizer_has_a_chat_template(tmp_path: Path) -> None:
    out = make_random_model(
        "smollm2-135m", tmp_path / "m", overrides={"vocab_size": 1000, "num_hidden_layers": 1}
    )
    tok = Tokenizer(out)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n"
    assert tok.decode(tok.encode(text, False), False) == text
