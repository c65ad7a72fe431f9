"""A Llama 3 GGUF's vocabulary (byte-level BPE under llama.cpp's "llama-bpe" pre-tokenizer) against Meta's own
Llama 3 tokenizer (llama-models: tiktoken over the published ranks, its `pat_str`). The GGUF metadata is made
here as llama.cpp's converter writes it from HF's tokenizer.json: each token's bytes as GPT-2's printable
characters, the merges derived from the ranks (each token split into two tokens of lower rank, in rank order),
the 256 special tokens as control tokens, BOS added. Then a tiny Llama GGUF with part of that vocabulary,
converted and run: its end-of-turn and end-of-message tokens end a sequence, and a chat prompt has one BOS."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_gguf_tokenizer import TEXTS

from tinypaged.weights.gguf_tokenizer import TOKEN_CONTROL, build_tokenizer

pytest.importorskip("tiktoken")
llama3 = pytest.importorskip("llama_models.llama3.tokenizer")

LLAMA3_TEXTS = [
    "1 12 123 1234 12345 1234567 3.14159 2024-12-05 ١٢٣٤",
    "I'M HERE, YOU'LL SEE, it'S, they'Re",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>",
    "tabs\t\tand\n\n\nnewlines \n \n  spaces   before",
    "x=[i**2 for i in range(10)]  # squares\r\n",
]


def _printable(b: int) -> str:
    """GPT-2's map of a byte to a printable character (byte-level BPE's vocabulary strings)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if b in keep:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(keep)).index(b))


def gguf_metadata(ranks: dict[bytes, int], specials: list[str]) -> dict:
    """The tokenizer.ggml.* metadata of a Llama 3 GGUF whose base vocabulary has these (dense) ranks and whose
    special tokens follow it, the first of them BOS."""
    chars = [_printable(b) for b in range(256)]

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        splits = [
            (ranks[token[:i]], ranks[token[i:]], token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        merges += [(rank, *split) for split in sorted(splits)]
    merges.sort()
    tokens = [text(t) for t, _ in sorted(ranks.items(), key=lambda kv: kv[1])]
    assert sorted(ranks.values()) == list(range(len(tokens)))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens + specials,
        "tokenizer.ggml.token_type": [1] * len(tokens) + [TOKEN_CONTROL] * len(specials),
        "tokenizer.ggml.merges": [f"{text(a)} {text(b)}" for _, _, _, a, b in merges],
        "tokenizer.ggml.bos_token_id": len(tokens),
        "tokenizer.ggml.add_bos_token": True,
    }


def _specials(reference) -> list[str]:  # noqa: ANN001
    named = sorted(reference.special_tokens.items(), key=lambda kv: kv[1])
    assert named[0] == ("<|begin_of_text|>", reference.bos_id) and named[0][1] == reference.n_words - len(
        named
    )
    return [name for name, _ in named]


@pytest.fixture(scope="module")
def reference():  # noqa: ANN201
    return llama3.Tokenizer.get_instance()


@pytest.fixture(scope="module")
def ours(reference):  # noqa: ANN201
    return build_tokenizer(gguf_metadata(reference.model._mergeable_ranks, _specials(reference)))


@pytest.mark.parametrize("text", TEXTS + LLAMA3_TEXTS)
def test_llama3_gguf_vocabulary_encodes_as_meta_s_tokenizer(ours, reference, text: str) -> None:
    """The same ids, BOS first (special tokens in the text matched whole, as HF's Llama 3 tokenizer does), and
    the text back."""
    want = reference.encode(text, bos=True, eos=False, allowed_special="all")
    got = ours.encode(text).ids
    assert got == want
    assert ours.decode(got[1:], skip_special_tokens=False) == text


# A Llama 3 chat template, shortened: the BOS, then each message between header tokens, ended by <|eot_id|>.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_a_llama3_gguf_converts_and_chats(tmp_path: Path, reference, monkeypatch) -> None:
    """A tiny Llama (random f32 weights) with the first 4,096 ranks of the Llama 3 vocabulary (closed under its
    merges) and its special tokens, written as llama.cpp writes one: converted, it tokenizes as tiktoken over
    the same ranks with Meta's `pat_str`, ends generation at <|eot_id|> and <|eom_id|> as well as at EOS, and
    the CLI's chat prompt starts with one BOS (the template's)."""
    import tiktoken

    from tinypaged.cli import main
    from tinypaged.config import ModelConfig
    from tinypaged.llm import LLM
    from tinypaged.tokenizer import Tokenizer
    from tinypaged.weights import convert_gguf

    gguf = pytest.importorskip("gguf")
    full = reference.model._mergeable_ranks
    kept = sorted((r, t) for t, r in full.items() if r < 4096 or len(t) == 1)
    ranks = {t: i for i, (_, t) in enumerate(kept)}
    names = _specials(reference)
    specials = {name: len(ranks) + i for i, name in enumerate(names)}
    want = tiktoken.Encoding(
        "llama3-4k", pat_str=reference.pat_str, mergeable_ranks=ranks, special_tokens=specials
    )
    meta = gguf_metadata(ranks, names)
    path = tmp_path / "llama3.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [
        (w.add_context_length, 256), (w.add_embedding_length, 64), (w.add_block_count, 1),
        (w.add_feed_forward_length, 96), (w.add_head_count, 4), (w.add_head_count_kv, 2),
        (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 5e5), (w.add_tokenizer_model, "gpt2"),
        (w.add_tokenizer_pre, "llama-bpe"), (w.add_token_list, meta["tokenizer.ggml.tokens"]),
        (w.add_token_types, meta["tokenizer.ggml.token_type"]), (w.add_token_merges, meta["tokenizer.ggml.merges"]),
        (w.add_bos_token_id, specials["<|begin_of_text|>"]), (w.add_eos_token_id, specials["<|end_of_text|>"]),
        (w.add_eot_token_id, specials["<|eot_id|>"]), (w.add_eom_token_id, specials["<|eom_id|>"]),
        (w.add_add_bos_token, True), (w.add_chat_template, TEMPLATE),
    ]:  # fmt: skip
        add(value)
    rng = np.random.default_rng(0)
    shapes = {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64)}
    shapes |= {
        "ffn_gate": (96, 64),
        "ffn_up": (96, 64),
        "ffn_down": (64, 96),
        "attn_norm": (64,),
        "ffn_norm": (64,),
    }
    vocab = len(meta["tokenizer.ggml.tokens"])
    w.add_tensor("token_embd.weight", rng.normal(0, 0.02, (vocab, 64)).astype(np.float32))
    for name, shape in shapes.items():
        w.add_tensor(f"blk.0.{name}.weight", rng.normal(0, 0.1, shape).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "out"
    convert_gguf(path, out)
    tok = Tokenizer(out)
    bos = specials["<|begin_of_text|>"]
    for text in TEXTS + LLAMA3_TEXTS:
        assert tok.encode(text) == [bos, *want.encode(text, allowed_special="all")], text
    ends = {specials[n] for n in ("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>")}
    assert set(ModelConfig.from_dir(out).eos_token_ids) == ends
    seen = []
    generate = LLM.generate
    monkeypatch.setattr(
        LLM, "generate", lambda self, prompts, *a: seen.extend(prompts) or generate(self, prompts, *a)
    )
    assert main(["generate", "--model", str(out), "--chat", "--max-tokens", "2", "Hi there"]) == 0
    text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert seen[0]["prompt_token_ids"] == want.encode(text, allowed_special="all")
    assert seen[0]["prompt_token_ids"].count(bos) == 1


def test_a_pre_tokenizer_not_run_is_refused_in_one_line() -> None:
    from tinypaged.weights import WeightsError

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "tekken", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(WeightsError, match="^unsupported GGUF pre-tokenizer 'tekken'$"):
        build_tokenizer(meta)
