"""What generation returns, shaped as vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgspec


class Logprob(msgspec.Struct, gc=False):
    """One token's log-probability and rank in the model's distribution.

    A request may hold a million of these (limits.MAX_LOGPROB_ENTRIES). Untracked by the cyclic garbage collector
    (they hold no references, so no cycles), they and the dicts that hold them cost its full collections nothing:
    tracked, a million of them made each collection take ~0.2 s, with the GIL held.
    """

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # Per generated token: {token id: Logprob} for the sampled token and the top-k alternatives.
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class RequestMetrics:
    """When a request reached each milestone, in `time.monotonic()` seconds (vLLM's RequestMetrics): its arrival
    in the engine, the steps that gave it its first and its latest tokens, and its end."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def copy(self) -> RequestMetrics:
        """A snapshot for an output (built field by field: ~4x cheaper than dataclasses.replace, once per
        request per step)."""
        return RequestMetrics(
            self.arrival_time, self.first_token_time, self.last_token_time, self.finished_time
        )

    def tokens_at(self, now: float) -> None:
        """Record a step that gave the request tokens, at `now`."""
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its outputs so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # Why the request ended early: it can never fit in the cache ("ignored": the request's own size), its
    # grammar did not compile ("invalid": refused after it was queued, by a client that did not wait for the
    # compile), or it failed inside the engine ("internal": a fault the engine isolated to it; the message
    # holds no internals).
    error: str | None = None
    error_kind: Literal["ignored", "invalid", "internal"] | None = None
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then one entry per prompt token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None  # as of this output
