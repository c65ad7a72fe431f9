"""A GGUF file's vocabulary as an HF `tokenizers.Tokenizer`: a byte-level BPE ("gpt2": SmolLM's, GPT-2's), or
SentencePiece ("llama": Gemma's, Llama 2's) as BPE over "▁"-joined text with byte fallback, its merges derived
from the pieces' scores (as HF's SentencePiece extractor derives them), a BOS prepended where the GGUF says so.
Control tokens are special (matched whole, skipped when decoding with skip_special_tokens), user-defined ones
matched whole but ordinary text.
"""

from __future__ import annotations

from typing import Any

from .errors import WeightsError

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
_SPACE = "\u2581"  # SentencePiece's "▁"
# llama.cpp's "llama-bpe" pre-tokenizer (Llama 3's tokenizer: its `pat_str`, also named "llama3" / "llama-v3"):
# letters with one leading non-letter, numbers in runs of up to three digits, punctuation runs with their
# newlines, whitespace runs; English contractions case-insensitively.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3")
# llama.cpp's "qwen2" pre-tokenizer (Qwen2's and Qwen3's tokenizer.json): digits one by one, letters with one
# leading non-letter, punctuation runs with their newlines, whitespace runs.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """The tokenizer of a GGUF file's metadata (everything checked: a WeightsError names what is not run, or
    what the `tokenizers` library refused of a damaged vocabulary or merge list, in one line)."""
    try:
        return _build(meta)
    except WeightsError:
        raise
    except Exception as e:  # tokenizers raises bare Exception / TypeError, over several lines
        why = (str(e).splitlines() or [""])[0]
        raise WeightsError(
            f"the GGUF's tokenizer cannot be built from its metadata ({type(e).__name__}: {why})"
        ) from e


def _build(meta: dict[str, Any]) -> Any:
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        tok = _sentencepiece(meta)
    elif kind == "gpt2":
        tok = _byte_level(meta)
    else:
        raise WeightsError(
            f"unsupported GGUF tokenizer model {kind!r} (byte-level BPE 'gpt2', SentencePiece 'llama')"
        )
    tokens, types = _tokens(meta)
    pairs = list(zip(tokens, types, strict=True))
    from tokenizers import AddedToken

    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in pairs if k == TOKEN_CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in pairs if k == TOKEN_USER_DEFINED]
    )
    if tok.get_vocab_size() != len(tokens):
        raise WeightsError(f"tokenizer has {tok.get_vocab_size()} tokens, GGUF lists {len(tokens)}")
    return tok


def _tokens(meta: dict[str, Any]) -> tuple[list[str], list[int]]:
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise WeightsError("GGUF vocabulary lacks a type per token")
    return tokens, types


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise WeightsError("GGUF vocabulary has duplicate tokens")
    return vocab


def _byte_level(meta: dict[str, Any]) -> Any:
    """A byte-level BPE from the GGUF vocabulary and merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pre = meta.get("tokenizer.ggml.pre")
    if pre not in ("smollm", "gpt2", "qwen2", *_LLAMA3_NAMES):
        raise WeightsError(f"unsupported GGUF pre-tokenizer {pre!r}")
    tokens, _ = _tokens(meta)
    if "tokenizer.ggml.merges" not in meta:
        raise WeightsError("GGUF metadata lacks 'tokenizer.ggml.merges'")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab=_vocab(tokens), merges=merges, fuse_unk=False, byte_fallback=False)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        # llama.cpp's "smollm" rule (and SmolLM2's own tokenizer.json): every digit is a piece of its own
        # before the GPT-2 regex runs, so " 42" is "Ġ", "4", "2" and a space run before a digit stays whole.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre == "qwen2" or pre in _LLAMA3_NAMES:  # a split by its regex, then bytes to their characters
        if pre == "qwen2":
            tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(
                    Regex(_QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT),
                    behavior="isolated",
                    invert=False,
                ),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    bos = _bos(meta, tokens)
    tokenizer.post_processor = processors.Sequence(
        [processors.ByteLevel(trim_offsets=False)] + ([bos] if bos is not None else [])
    )
    return tokenizer


def _bos(meta: dict[str, Any], tokens: list[str]) -> Any:
    """The post-processor that puts BOS first where the GGUF asks for it (`add_bos_token`), else None."""
    from tokenizers import processors

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if not meta.get("tokenizer.ggml.add_bos_token") or bos_id is None:
        return None
    bos = tokens[bos_id]
    return processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )


def _sentencepiece(meta: dict[str, Any]) -> Any:
    """A SentencePiece vocabulary (pieces, scores) as BPE with byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens, _ = _tokens(meta)
    scores: list[float] = list(meta.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens):
        raise WeightsError("GGUF SentencePiece vocabulary lacks a score per token")
    vocab = _vocab(tokens)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab=vocab,
        merges=_merges(tokens, scores, vocab),
        unk_token=None if unk_id is None else tokens[unk_id],
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(_SPACE)] if prefix else []) + [normalizers.Replace(" ", _SPACE)]
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(_SPACE, 1, 0)] if prefix else [])
    )
    bos = _bos(meta, tokens)
    if bos is not None:
        tok.post_processor = bos
    return tok


def _merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, highest-scoring piece first (within one piece, by the parts' ids):
    BPE over these merges reproduces SentencePiece's BPE."""
    found = []
    for piece, score in zip(tokens, scores, strict=True):
        local = [
            (vocab[piece[:i]], vocab[piece[i:]], piece[:i], piece[i:])
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        found += [(score, left, right) for _, _, left, right in sorted(local)]
    found.sort(key=lambda m: -m[0])  # stable: ties keep the vocabulary's order
    return [(left, right) for _, left, right in found]
