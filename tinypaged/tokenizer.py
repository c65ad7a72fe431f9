"""Tokenizer: HF `tokenizers` from tokenizer.json, chat templates, incremental detokenization."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from tinypaged.config import ConfigError


def _token_str(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a plain string or an AddedToken-style dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Text <-> token ids for one model directory, with its chat template."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(f"no tokenizer.json in model directory {path}")
        try:
            self._tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ConfigError(f"cannot read {file}: {e}") from e
        cfg_file = path / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # the named-templates form: take the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template = None
        if self.chat_template:
            # As HF renders templates: loop controls, its `tojson` (keys in their order, no HTML escaping: Qwen's
            # and Mistral's templates write the tools with it) and `strftime_now` (Llama 3.x's, Mistral's dates).
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = _tojson
            self._template = env.from_string(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the tokenizer's BOS/EOS post-processing when add_special_tokens)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # HF tokenizers releases the GIL in its batch calls only: these two let a long text be encoded (or a long
    # id list decoded) in a thread while an event loop keeps running beside it.
    def encode_unlocked(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode(), releasing the GIL while the tokenizer works."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode_unlocked(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """decode(), releasing the GIL while the tokenizer works."""
        return self._tok.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (the longest vocabulary entry: a byte-level entry has a
        character per byte, never fewer than its text): a text has at least len(text) / this many tokens."""
        return max(len(t) for t in self._tok.get_vocab(with_added_tokens=True))

    def surely_longer_than(self, text: str, max_tokens: int) -> bool:
        """Whether `text` has more than `max_tokens` tokens, known from its length alone (no tokenizing)."""
        return len(text) > max_tokens * self.max_token_chars

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of one id."""
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render chat messages (and the tools the model may call, OpenAI's `tools` as HF passes them; a template
        that does not read them leaves them out) with the model's template (run in jinja2's sandbox: it is code
        from the model)."""
        if self._template is None:
            raise ValueError("this model has no chat template; use the completions API")
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas that are always whole UTF-8 characters.

    Decoding a window that starts a few tokens back keeps the tokenizer's spacing rules right; a delta is held
    back while it ends in U+FFFD, i.e. while a multi-byte character is still split across tokens.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:])  # a little prompt context for the first token's spacing
        self.num_outputs = 0  # output ids taken so far
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def step(self, new_ids: Sequence[int]) -> str:
        """Append output ids; return the newly complete text (possibly empty)."""
        self.ids.extend(new_ids)
        self.num_outputs += len(new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy in the same state (a forked sequence continues from the same text)."""
        twin = copy.copy(self)
        twin.ids = list(self.ids)
        return twin

    def flush(self) -> str:
        """At the end of generation, emit whatever is held back (a dangling partial character included)."""
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        prefix = self.tokenizer.decode(
            self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
