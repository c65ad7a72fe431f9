"""The one way the engine's outputs become an endpoint's answer: the whole response, or its SSE events.

Both are written once, over each choice's delta (text, token ids, logprobs, finish) since the last chunk;
completions.py and chat.py each give them a `Formatter`: how a delta looks in that endpoint's wire format.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from tinypaged.outputs import CompletionOutput, Logprob, RequestOutput
from tinypaged.sampling_params import SamplingParams
from tinypaged.server import protocol as p
from tinypaged.server.errors import APIError, internal_error
from tinypaged.server.serving import final_only

_encoder = msgspec.json.Encoder()


def sse(payload: Any) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ChoiceDelta:
    """What one choice gained since its last chunk (all of it, for a response that is not streamed)."""

    index: int  # in the response: prompt index * n + output index, as OpenAI and vLLM number choices
    prompt_index: int
    request: RequestOutput  # the choice's request as it stands (its prompt's ids and logprobs, for echo)
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    first: bool  # nothing of the choice was sent before
    finish_reason: str | None  # set in the choice's last delta only
    stop_reason: int | str | None


@dataclass
class ChoiceState:
    """What has been sent of one choice so far."""

    started: bool = False
    done: bool = False
    text_len: int = 0
    num_tokens: int = 0

    def advance(self, prompt_index: int, n: int, out: RequestOutput, o: CompletionOutput) -> ChoiceDelta:
        """What output `o` of the prompt's request gained since the last call; the choice is done once `o` is.

        The engine's text of a running output already holds back any tail that could begin a stop string, so
        text sent is never cut later.
        """
        finished = o.finish_reason is not None
        delta = ChoiceDelta(
            index=prompt_index * n + o.index,
            prompt_index=prompt_index,
            request=out,
            text=o.text[self.text_len :],
            token_ids=o.token_ids[self.num_tokens :],
            logprobs=o.logprobs[self.num_tokens :] if o.logprobs is not None else None,
            first=not self.started,
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason if finished else None,
        )
        self.started, self.done = True, finished
        self.text_len, self.num_tokens = len(o.text), len(o.token_ids)
        return delta


class Formatter(Protocol):
    """One endpoint's wire format for the choice deltas `respond` and `stream` hand it, one choice at a time."""

    def head(self, d: ChoiceDelta) -> msgspec.Struct | None:
        """What a stream sends of a choice before its first delta, in a chunk of their own (chat: the role)."""
        ...

    def delta(self, d: ChoiceDelta) -> msgspec.Struct | None:
        """A streamed chunk's choice for the delta; None when it adds nothing."""
        ...

    def choice(self, d: ChoiceDelta) -> msgspec.Struct:
        """A response's choice, from a delta holding the whole of it."""
        ...

    def chunk(self, choices: list[Any], usage: p.UsageInfo | None = None) -> msgspec.Struct:
        """One streamed chunk; the usage goes in a last one, without choices."""
        ...

    def response(self, choices: list[Any], usage: p.UsageInfo) -> msgspec.Struct:
        """The whole response."""
        ...


async def respond(
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    req: p.CompletionRequest | p.ChatCompletionRequest,
    params: list[SamplingParams],
    formatter: Formatter,
) -> msgspec.Struct | AsyncGenerator[bytes, None]:
    """The prompts' choices (`n` each, from `OpenAIServing.generate`): the whole response, or its SSE events
    when `req.stream`."""
    n = params[0].n
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return stream(outputs, n, formatter, final_only(params[0]), usage)
    finals = await collect(outputs, len(params))

    def build() -> msgspec.Struct:
        choices = [
            formatter.choice(ChoiceState().advance(i, n, out, o))  # a fresh state: the whole choice at once
            for i, out in enumerate(finals)
            for o in out.outputs
        ]
        return formatter.response(choices, usage_of(finals))

    if any(sp.logprobs is not None or sp.prompt_logprobs is not None for sp in params):
        # Up to a million logprob entries (docs/limits.md) take a second to format: in a thread, the GIL shared
        # at its switch interval, so the event loop keeps serving the other requests meanwhile.
        return await asyncio.to_thread(build)
    return build()


async def stream(
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    n: int,
    formatter: Formatter,
    wait: bool,
    include_usage: bool,
) -> AsyncGenerator[bytes, None]:
    """SSE events of every prompt's choices as they grow, then the usage chunk (when asked for) and [DONE].

    For each engine output: one chunk of the heads of choices new to the stream (chat's role), then one of the
    choices that gained something. With `wait` (see `final_only`) each choice comes whole when its prompt's
    request is done. A request the engine failed raises before any of its output is sent.
    """
    sent: dict[tuple[int, int], ChoiceState] = {}  # by (prompt index, output index)
    finals: list[RequestOutput] = []
    async with contextlib.aclosing(outputs):
        async for i, out in outputs:
            if wait and not out.finished:
                continue
            if out.finished:
                raise_if_failed(out)
                finals.append(out)
            deltas = []
            for o in out.outputs:
                st = sent.setdefault((i, o.index), ChoiceState())
                if not st.done:
                    deltas.append(st.advance(i, n, out, o))
            heads = [h for d in deltas if d.first and (h := formatter.head(d)) is not None]
            if heads:
                yield sse(formatter.chunk(heads))
            choices = [c for d in deltas if (c := formatter.delta(d)) is not None]
            if choices:
                yield sse(formatter.chunk(choices))
    if include_usage:
        yield sse(formatter.chunk([], usage_of(finals)))
    yield SSE_DONE


async def collect(outputs: AsyncGenerator[tuple[int, RequestOutput], None], n: int) -> list[RequestOutput]:
    """The final output of each of `n` merged requests, in index order."""
    finals: list[RequestOutput | None] = [None] * n
    async with contextlib.aclosing(outputs):
        async for i, out in outputs:
            if out.finished:
                raise_if_failed(out)
                finals[i] = out
    assert all(f is not None for f in finals)
    return finals  # type: ignore[return-value]


def raise_if_failed(out: RequestOutput) -> None:
    """A request the engine ended early: 400 when it can never fit in the cache, 500 naming it when the engine
    failed while running it (alone: the others went on)."""
    if out.error_kind == "internal":
        raise internal_error(out.request_id, out.error or "an internal error")
    if out.error:
        raise APIError(400, out.error)


def usage_of(finals: list[RequestOutput]) -> p.UsageInfo:
    """Token counts of finished requests: each prompt once, every choice's output."""
    prompt = sum(len(out.prompt_token_ids) for out in finals)
    completion = sum(len(o.token_ids) for out in finals for o in out.outputs)
    return p.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
