"""A request as the engine holds it, and the one small interface its strategy implements. Plain data, no torch.

Each step the engine asks a request's strategy which draws to make from the logits row of every sequence that
samples (`Strategy.draws`), queues them all in one sampler pass, and hands each request the results of its
draws (`Strategy.plan`). The strategy answers with a `Plan`: which sequences fork from which, which sequence
each token extends, which sequences are dropped or finished. The engine applies the plan through the
scheduler, so a fork shares every block of its parent (copied on write later), as the paper has it; the output
processor then detokenizes each new token and checks the stop conditions. `Strategy.outputs` says what the
request reports. The strategies: `ParallelSampling` (parallel_sampling.py: n or best_of samples, n = 1
included) and `BeamSearch` (beam_search.py).
"""

from __future__ import annotations

from collections.abc import Sequence as Sequence_
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

from tinypaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from tinypaged.outputs import CompletionOutput, Logprob, RequestMetrics
from tinypaged.sampling_params import SamplingParams
from tinypaged.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from llguidance import LLMatcher


Prompt = str | dict[str, Any]  # text, or {"prompt_token_ids": [...]} with an optional "prompt" text


@dataclass(frozen=True)
class EngineRequest:
    """A checked request, ready to queue: what `LLMEngine.process_inputs` returns and `LLMEngine.add` takes."""

    request_id: str
    prompt: str | None  # the prompt's text, when there is one
    prompt_token_ids: list[int]
    params: SamplingParams
    # With params.structured_outputs: its own matcher at its grammar's start, built in the engine's grammar pool
    # once the grammar compiled (`GrammarCompiler.start`).
    grammar: Future[LLMatcher] | None = None
    # The client request this is one prompt of (`SequenceGroup.client_request_id`): admission takes turns
    # between client requests. None: a client request of its own.
    client_request_id: str | None = None
    # When it arrived (time.monotonic()); None: when it is queued. The requests of one LLM.generate batch
    # arrive together, however long checking them takes.
    arrival_time: float | None = None


@dataclass
class SeqState:
    """What the core does not keep about one sequence: its text, logprobs, random stream, why it stopped."""

    index: int  # its position among the request's outputs (and its random stream under a seed)
    detok: IncrementalDetokenizer | None  # None under beam search: beams are decoded whole when reported
    seed_key: int | None = None
    text: str = ""  # everything detokenized so far (cut at the stop string once one is found)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    matcher: LLMatcher | None = None  # structured outputs: the grammar's state after this sequence's tokens

    def fork(self, index: int, seed_key: int | None) -> SeqState:
        """A copy for a forked sequence: the same text, logprobs, detokenizer and grammar state so far."""
        return replace(
            self,
            index=index,
            seed_key=seed_key,
            detok=self.detok.fork() if self.detok is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            matcher=self.matcher.deep_copy() if self.matcher is not None else None,
        )


# ---- the strategy interface ----------------------------------------------------------------------------


# Draws, samples and plans are made for every sequence of every step: named tuples, the cheapest immutable
# records Python has (a frozen dataclass pays a setattr call per field).


class Draw(NamedTuple):
    """One draw a strategy asks of the logits row of `seq` this step."""

    seq: Sequence
    seed_key: int | None  # the random stream the draw uses (None: torch's generator)
    fork: int | None = None  # None: the token extends `seq`; k: it starts output k, a fork of `seq`
    scores: bool = False  # the whole log-probability row instead of a sampled token (beam search)
    # The token may stay on the device until the next step (async scheduling): only when nothing that the next
    # schedule or the next sampling needs on the host depends on it (no fork, no beam step, no penalty).
    defer: bool = False
    # Speculative decoding: tokens proposed after `seq`'s last one, verified from this draw's k + 1 rows; its
    # result is then a list of TokenSamples (the accepted proposals and one drawn token).
    spec: tuple[int, ...] = ()


class TokenSample(NamedTuple):
    """A sampled token, with its logprob and rank when computed, and the top alternatives when asked for."""

    token: int
    logprob: float | None = None
    rank: int | None = None  # 1 = the most likely token
    top: list[tuple[int, float]] | None = None  # (token, logprob), best first


@dataclass(frozen=True, eq=False)
class Fork:
    """A new sequence of the request sharing every block of `parent`, as the parent was before this step."""

    parent: Sequence
    index: int  # its output index (and random stream)


class Extend(NamedTuple):
    """Append `sample.token` to a sequence: an existing one, or a fork made by the same plan."""

    target: Sequence | Fork
    sample: TokenSample
    cumulative_logprob: float | None = None  # replaces the running sum (beam search); else logprob adds


class Plan(NamedTuple):
    """What a request's sequences do with one step's results, in this order: forks, appends, drops, finishes."""

    extend: list[Extend]  # a token for each sequence the step extends (a fork's first token included)
    forks: Sequence_[
        Fork
    ] = ()  # new sequences, made before any token is appended (their targets in `extend`)
    drop: Sequence_[Sequence] = ()  # left behind for good: blocks freed, forgotten
    finish: Sequence_[Sequence] = ()  # the request is done with them (stopped)


class Strategy(Protocol):
    """A request's way of choosing tokens (see the module docstring)."""

    def draws(self, req: Request, seq: Sequence) -> list[Draw]:
        """The draws to make from `seq`'s logits row this step."""
        ...

    def plan(self, req: Request, results: list[tuple[Draw, Any]]) -> Plan:
        """What to do with this step's results: a TokenSample per token draw, a log-probability row (a
        tensor over the vocabulary) per scores draw."""
        ...

    def outputs(self, req: Request) -> list[CompletionOutput]:
        """The request's outputs as they stand."""
        ...


@dataclass(eq=False)
class Request:
    """One request inside the engine: its sequence group, how it samples, and its outputs' state."""

    group: SequenceGroup
    prompt: str | None
    prompt_token_ids: list[int]  # one list for the request's life: every RequestOutput shares it
    params: SamplingParams
    strategy: Strategy
    metrics: RequestMetrics  # its milestones' times (RequestOutput.metrics), from its arrival on
    states: dict[int, SeqState] = field(default_factory=dict)  # by seq_id
    # With params.prompt_logprobs: None for the first prompt token, then one entry per prompt token scored.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    constrained: bool = False  # structured outputs: each sequence follows a matcher (SeqState.matcher)
    error: str | None = None  # why it ended early (RequestOutput.error)
    error_kind: Literal["ignored", "invalid", "internal"] | None = None

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.group.request_id


# ---- a sequence's text and its snapshot (the output processor and the strategies both use them) ----

FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
}


def sync_text(seq: Sequence, state: SeqState) -> None:
    """Detokenize the sequence's output tokens not yet in `state.text` (all at once gives the same text as one
    at a time; beams have no detokenizer: they are decoded whole when reported)."""
    detok = state.detok
    if detok is not None:
        done = seq.prompt_len + detok.num_outputs
        if done < len(seq.token_ids):
            state.text += detok.step(seq.token_ids[done:])


def end_text(seq: Sequence, state: SeqState, status: SequenceStatus) -> SequenceStatus:
    """The sequence's text complete as it ends with `status` (returned): the last tokens and any partial
    character flushed."""
    if state.detok is not None:
        sync_text(seq, state)
        state.text += state.detok.flush()  # a dangling partial character, if any
    return status


def visible_text(params: SamplingParams, state: SeqState, finished: bool) -> str:
    """The text a stream may show: while running, a tail that could still begin a stop string is held back."""
    text = state.text
    if finished or not params.stop:
        return text
    hold = 0
    for stop in params.stop:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return text[: len(text) - hold] if hold else text


def completion(params: SamplingParams, seq: Sequence, state: SeqState, index: int) -> CompletionOutput:
    """A snapshot of one sequence as vLLM's CompletionOutput (lists copied: the state keeps growing)."""
    finished = seq.status.is_finished
    sync_text(seq, state)
    return CompletionOutput(
        index=index,
        text=visible_text(params, state, finished),
        token_ids=seq.token_ids[seq.prompt_len :],
        cumulative_logprob=state.cumulative_logprob if params.logprobs is not None else None,
        logprobs=list(state.logprobs) if state.logprobs is not None else None,
        finish_reason=FINISH_REASON.get(seq.status),
        stop_reason=state.stop_reason,
    )
