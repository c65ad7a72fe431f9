"""The converted tokenizer.json against HF transformers' tokenizer built from the same GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, pre_tokenizers

TEXTS = [
    "Hello, world! How are you today?",
    "def fib(n: int) -> int:\n\tif n < 2:\n\t\treturn n\n\treturn fib(n - 1) + fib(n - 2)\n",
    'const x = {"a": [1, 2.5e-3, null], b: `${y}`}; // JSON-ish\n',
    "北京是中华人民共和国的首都，也是全国的政治中心。",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "Привет, мир! Как дела? Ёжик в тумане.",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "emoji 🤖🎉 👍🏽 👨‍👩‍👧 ok ☕",
    "   leading spaces,  double,   triple    quad\n\n\n\ttabs\t\tand trailing   ",
    "\r\nwindows\r\nline endings\r\n",
    "year 2024, pi=3.14159, x\u00b2 + y\u00b3, (١٢٣) (४२)",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><file_sep>a<repo_name>b<jupyter_code>",
    "it's they're we've I'm you'll he'd",
    "",
    " ",
    "ﬁ ligature, e\u0301 combining, \u00a0nbsp, zero\u200bwidth",
]

# Whitespace runs before a digit: here transformers' GGUF reader (no entry for llama.cpp's "smollm"
# pre-tokenizer) falls back to plain GPT-2 splitting, while llama.cpp and SmolLM2's own tokenizer.json
# first cut every digit (\p{N}) out on its own, so "a   12" is "a", "ĠĠĠ", "1", "2" and not "a", "ĠĠ", "Ġ12".
DIGIT_TEXTS = ["a   12", "  42", "\n\n 7", "x =   3.5\t\t9", "costs  $ 100  or 200", "Arabic ١٢٣, Hindi ४२"]

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Translate 'cat' to 中文 and العربية 🐱"},
        {"role": "assistant", "content": "猫 / قطة"},
        {"role": "user", "content": "  and\tRussian?\n"},
    ],
]


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def smollm_oracle(oracle_tokenizer):
    """The oracle's vocabulary and merges behind llama.cpp's "smollm" split (\\p{N} first, then GPT-2's)."""
    backend = Tokenizer.from_str(oracle_tokenizer.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), backend.pre_tokenizer]
    )
    return backend


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_oracle(tokenizer: Tokenizer, oracle_tokenizer, text: str) -> None:
    assert tokenizer.encode(text, add_special_tokens=False).ids == oracle_tokenizer.encode(
        text, add_special_tokens=False
    )


@pytest.mark.parametrize("text", TEXTS + DIGIT_TEXTS)
def test_ids_match_oracle_with_llama_cpp_digit_split(tokenizer: Tokenizer, smollm_oracle, text: str) -> None:
    assert tokenizer.encode(text, add_special_tokens=False).ids == smollm_oracle.encode(text).ids


def test_digits_are_single_pieces(tokenizer: Tokenizer) -> None:
    vocab = tokenizer.get_vocab()
    assert tokenizer.encode("a   12").ids == [vocab["a"], vocab["ĠĠĠ"], vocab["1"], vocab["2"]]
    assert tokenizer.encode(" 2024").ids == [vocab["Ġ"]] + [vocab[d] for d in "2024"]


@pytest.mark.parametrize("text", TEXTS + DIGIT_TEXTS)
def test_decode_round_trips(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi"
    assert tokenizer.get_vocab_size() == 49152
    assert [tokenizer.id_to_token(i) for i in (0, 1, 2)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.mark.parametrize("chat", CHATS)
def test_chat_template_matches_oracle(model_dir: Path, tokenizer: Tokenizer, oracle_tokenizer, chat) -> None:
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(model_dir)
    text = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == oracle_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.encode(text).ids == oracle_tokenizer.encode(text, add_special_tokens=False)
