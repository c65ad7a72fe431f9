"""What a KV-aware router knows, without Ray: a request's routing key (the chained hashes of its prompt's full
blocks, computed as the block pool computes them) and a replica's cached hashes (replayed from its engine's
prefix-cache events).

The key is made in the ingress from the request body, tokenized as the server tokenizes it (a completion's prompt
with special tokens, a chat's messages through the chat template). It only steers routing: a key that differs
from what the replica computes (tools the template would render, say) costs a cache miss, never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from tinypaged.core.block_pool import BlockEvent, BlockHash, hash_block_tokens
from tinypaged.server import protocol as p
from tinypaged.server.chat_template import template_message
from tinypaged.tokenizer import Tokenizer

# Paths whose body names a prompt worth routing by.
PROMPT_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_LONGEST_KEY = 4096  # blocks: a longer prompt is keyed by its first this many blocks


def block_key(block_hash: BlockHash) -> int:
    """A block hash as routers hold it: its first 8 bytes (routing only, so a collision costs a miss)."""
    return int.from_bytes(block_hash[:8], "little")


def prompt_block_keys(token_ids: list[int], block_size: int) -> tuple[int, ...]:
    """The keys of the prompt's full blocks, chained as the block pool chains them (hash_block_tokens)."""
    keys: list[int] = []
    parent: BlockHash | None = None
    for start in range(0, min(len(token_ids) // block_size, _LONGEST_KEY) * block_size, block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[start : start + block_size]))
        keys.append(block_key(parent))
    return tuple(keys)


@dataclass
class RoutedRequest:
    """One HTTP request on its way from the ingress to a replica, with what routers read: `prompt` (its text,
    which Ray's PrefixCacheAffinityRouter matches) and `block_keys` (what the KV-aware router matches)."""

    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    prompt: str = ""
    block_keys: tuple[int, ...] = ()
    attempt: int = 0  # replicas tried before this one (each died before answering)


def route_key(
    tokenizer: Tokenizer, block_size: int, path: str, body: bytes
) -> tuple[str, tuple[int, ...]] | None:
    """The prompt text and block keys of a generation request's body; None when it has none to route by (a bad
    body: the replica answers it with the proper error)."""
    try:
        if path == "/v1/completions":
            req = msgspec.json.decode(body, type=p.CompletionRequest)
            if not isinstance(req.prompt, str):
                return None  # token ids or a batch of prompts: routed by load alone
            return req.prompt, prompt_block_keys(tokenizer.encode(req.prompt, True), block_size)
        if path == "/v1/chat/completions":
            chat = msgspec.json.decode(body, type=p.ChatCompletionRequest)
            dicts = [template_message(m, "") for m in chat.messages]
            text = tokenizer.apply_chat_template(dicts, add_generation_prompt=chat.add_generation_prompt)
            return text, prompt_block_keys(tokenizer.encode(text, False), block_size)
    except Exception:  # noqa: BLE001 - any refusal is the replica's to answer
        return None
    return None


@dataclass
class CachedBlocks:
    """A replica's view of its engine's prefix cache: the keys of the cached block hashes, kept by replaying the
    engine's events step by step (`apply`: a step listener's work)."""

    keys: set[int] = field(default_factory=set)
    version: int = 0  # events applied so far

    def apply(self, events: Iterable[BlockEvent]) -> None:
        """Replay one step's events, in order."""
        for kind, block_hash in events:
            self.version += 1
            if kind == "cleared":
                self.keys.clear()
            elif kind == "stored":
                assert block_hash is not None
                self.keys.add(block_key(block_hash))
            else:
                assert block_hash is not None
                self.keys.discard(block_key(block_hash))


def longest_prefix(keys: tuple[int, ...], *held: set[int] | frozenset[int]) -> int:
    """How many of the leading `keys` are each in one of the `held` sets (a chain: a block past a missing one
    cannot hit)."""
    n = 0
    for key in keys:
        if not any(key in h for h in held):
            break
        n += 1
    return n
