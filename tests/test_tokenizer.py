"""The tokenizer: incremental detokenization streams whole UTF-8 characters, once; chat templates render."""

from __future__ import annotations

import pytest

from tinypaged.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world! Plain ASCII with  double  spaces\tand tabs.\n\nNew paragraph.",
    "emoji: 👩‍👩‍👧‍👦 🚀🔥 and flags 🇫🇷🇯🇵",
    "中文字符测试，还有日本語のテキスト。",
    "Русский текст и العربية и हिन्दी",
    "def f(x):\n    return {'a': [1, 2, 3]}  # café naïve",
    "<|im_start|>user\nspecial tokens<|im_end|>",
]


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization(tok: Tokenizer, text: str) -> None:
    prompt = tok.encode("Prompt:")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
    deltas = [detok.step([t]) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False) == detok.text


def test_split_character_comes_out_once_and_whole(tok: Tokenizer) -> None:
    ids = tok.encode("🚀")
    assert len(ids) > 1  # byte-level BPE splits the 4-byte character
    detok = IncrementalDetokenizer(tok, tok.encode("a"))
    deltas = [detok.step([t]) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🚀"


def test_dangling_partial_character_is_flushed(tok: Tokenizer) -> None:
    ids = tok.encode("🚀")[:-1]
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.step([t]) for t in ids) == ""
    assert detok.flush() == tok.decode(ids)


def test_chat_template(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert "<|im_start|>user\nHi there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token_id == tok.encode("<|im_end|>", add_special_tokens=False)[0]


def test_chat_template_is_sandboxed(tmp_path, model_dir) -> None:
    import json
    import shutil

    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": evil}))
    with pytest.raises(ValueError, match="chat template"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


# What the families' templates use beyond plain Jinja: Qwen's and Mistral's `tojson` of the tools (keys as given,
# no HTML escaping), a loop `break`, `raise_exception`, `strftime_now`, string methods.
FAMILY_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>{% endif %}"
    "{%- for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
    "{%- if m.role not in ['user', 'assistant'] %}{{ raise_exception('roles must be user/assistant') }}{% endif %}"
    "<start_of_turn>{{ m.role }}\n{{ m.content.split('</think>')[-1].lstrip('\\n') | trim }}<end_of_turn>\n"
    "{%- endfor %}{{ strftime_now('%Y') | length }}"
)


def test_family_template_renders_as_hf_does(tmp_path, model_dir) -> None:
    import json
    import shutil

    from transformers import PreTrainedTokenizerFast

    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": FAMILY_TEMPLATE}))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": "<b> & é"}}}]
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>hmm</think>\n\nHello"},
        {"role": "stop", "content": ""},
        {"role": "system", "content": "never rendered"},
    ]
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), chat_template=FAMILY_TEMPLATE
    )
    want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert Tokenizer(tmp_path).apply_chat_template(messages, tools=tools) == want
    assert '{"z": 1, "a": "<b> & é"}' in want
    with pytest.raises(ValueError, match="roles must be"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "system", "content": "x"}])
