"""Engine logprobs (`{token id: Logprob}` per token) in OpenAI's two response formats."""

from __future__ import annotations

from collections.abc import Sequence

from tinypaged.outputs import Logprob
from tinypaged.server import protocol as p
from tinypaged.tokenizer import Tokenizer

Entries = Sequence[dict[int, Logprob] | None] | None


def _token_text(token_id: int, entry: dict[int, Logprob] | None, tokenizer: Tokenizer) -> str:
    lp = entry.get(token_id) if entry else None
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id], False)


def _top(entry: dict[int, Logprob], k: int, token_id: int | None) -> list[tuple[int, Logprob]]:
    """The entry's alternatives of rank <= k (and the sampled token, when given), best first."""
    items = [(t, lp) for t, lp in entry.items() if lp.rank <= k or t == token_id]
    return sorted(items, key=lambda item: item[1].rank)


def extend_legacy(
    logprobs: p.CompletionLogprobs,
    token_ids: Sequence[int],
    entries: Entries,
    k: int,
    tokenizer: Tokenizer,
    offset: int,
) -> int:
    """Append tokens to the legacy completions format, the first at text offset `offset` in the choice;
    returns the offset after the last one."""
    for j, token in enumerate(token_ids):
        entry = entries[j] if entries is not None and j < len(entries) else None
        text = _token_text(token, entry, tokenizer)
        lp = entry.get(token) if entry else None
        logprobs.tokens.append(text)
        logprobs.token_logprobs.append(lp.logprob if lp is not None else None)
        logprobs.top_logprobs.append(
            {_token_text(t, entry, tokenizer): alt.logprob for t, alt in _top(entry, k, token)}
            if entry
            else None
        )
        logprobs.text_offset.append(offset)
        offset += len(text)
    return offset


def chat_logprobs(token_ids: Sequence[int], entries: Entries, k: int, tokenizer: Tokenizer) -> p.ChatLogprobs:
    """The chat format: per token its text, logprob, UTF-8 bytes and the top `k` alternatives."""
    content = []
    for j, token in enumerate(token_ids):
        entry = entries[j] if entries is not None and j < len(entries) else None
        lp = entry.get(token) if entry else None
        if entry is None or lp is None:
            continue
        text = _token_text(token, entry, tokenizer)
        top = [
            p.TopLogprob(
                token=(alt_text := _token_text(t, entry, tokenizer)),
                logprob=alt.logprob,
                bytes=list(alt_text.encode()),
            )
            for t, alt in _top(entry, k, None)
        ]
        content.append(
            p.ChatTokenLogprob(
                token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top[:k]
            )
        )
    return p.ChatLogprobs(content=content)
