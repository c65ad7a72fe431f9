"""What crosses between the server's process and the engine-core process, and the pipe it crosses.

Requests, aborts and queries go to the core as pickled tuples (one per request: their size is the prompt's).
Outputs come back once per step as one msgspec message: each request's output as a delta against the last one
sent for it (the new tokens, text and logprobs), so a step's message grows with the step's tokens, not with
the requests' lengths; the server's side rebuilds vLLM's cumulative RequestOutput from it. Logprobs travel in
chunks encoded apart (`LOGPROB_CHUNK` tokens' entries each) that the server decodes one at a time: a request
that finishes with a million entries would otherwise hold the server's GIL for seconds in one decode call, and
its event loop with it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec

from tinypaged.engine.step.stats import EngineStats, StepStats
from tinypaged.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

logger = logging.getLogger(__name__)

LOGPROB_CHUNK = 256  # tokens' logprob entries per chunk: up to ~5k Logprobs, a few ms to decode
_encode_logprobs = msgspec.msgpack.Encoder().encode
_decode_logprobs = msgspec.msgpack.Decoder(list[dict[int, Logprob] | None]).decode


def pack_logprobs(entries: list | None) -> list[msgspec.Raw] | None:
    """Logprob entries (per token: {token id: Logprob}, or None) as separately encoded chunks."""
    if entries is None:
        return None
    step = LOGPROB_CHUNK
    return [msgspec.Raw(_encode_logprobs(entries[i : i + step])) for i in range(0, len(entries), step)]


def unpack_logprobs(chunks: list[msgspec.Raw] | None) -> list | None:
    """The entries `pack_logprobs` packed, decoded chunk by chunk (other threads get the GIL in between)."""
    if chunks is None:
        return None
    entries: list = []
    for chunk in chunks:
        entries += _decode_logprobs(chunk)
    return entries


class SeqDelta(msgspec.Struct, array_like=True):
    """One output of a request: what to keep of the last one sent at this position, and what follows."""

    index: int
    keep_tokens: int
    token_ids: list[int]
    keep_text: int
    text: str
    keep_logprobs: int
    logprobs: list[msgspec.Raw] | None  # pack_logprobs
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


class OutputDelta(msgspec.Struct, array_like=True):
    """One request's output after a step, against the last one sent for it."""

    request_id: str
    outputs: list[SeqDelta]
    finished: bool
    error: str | None
    error_kind: str | None
    keep_prompt_logprobs: int
    prompt_logprobs: list[msgspec.Raw] | None  # pack_logprobs
    metrics: RequestMetrics | None


class Ready(msgspec.Struct, tag=True):
    """The core has built its engine and takes requests."""

    stats: EngineStats


class Outputs(msgspec.Struct, tag=True):
    """After a step (`step` its statistics) or after applying requests and aborts between steps (`step` None):
    the outputs of the requests it advanced, and the engine's load. `applied` counts the requests added so far,
    so the server knows which of those it sent still wait in the pipe."""

    applied: int
    outputs: list[OutputDelta]
    stats: EngineStats
    step: StepStats | None


class Failed(msgspec.Struct, tag=True):
    """These requests ended on an error: a request the engine refused (`param` names its parameter) or one a
    failed step took down."""

    request_ids: list[str]
    message: str
    refused: bool
    param: str | None = None
    code: str | None = None


class Reply(msgspec.Struct, tag=True):
    """The answer to query `token` (a snapshot, a grammar compile, an integrity check): a pickled result, or the
    error (`refused`: a RequestError naming `param`)."""

    token: int
    result: bytes = b""
    error: str | None = None
    refused: bool = False
    param: str | None = None
    code: str | None = None


class Dead(msgspec.Struct, tag=True):
    """The core cannot go on (or could not start): why, and the pickled exception where it has one."""

    message: str
    exception: bytes = b""


class Beat(msgspec.Struct, tag=True):
    """The core's heartbeat, sent by a thread of its own every few tenths of a second whatever its main loop
    does: how long the main loop has been in its current step (0 while it waits for work). The server tells a
    stalled step (`busy_s` growing) from a frozen process (no beat at all)."""

    busy_s: float


Message = Ready | Outputs | Failed | Reply | Dead | Beat
encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder(Message).decode


class DeltaEncoder:
    """The core's side: each request's output as a delta against the last one sent for it.

    A request's outputs only grow (its tokens, text and logprobs append) except under beam search and best_of
    > n, whose reported sequences change: those go whole (`whole`). A text that does not extend the last one
    sent goes whole too.
    """

    def __init__(self) -> None:
        # request id -> (sends whole outputs, per output position: the tokens, text and logprob count sent)
        self._sent: dict[str, tuple[bool, list[tuple[int, str, int]]]] = {}
        self._prompt_logprobs: dict[str, int] = {}

    def add(self, request_id: str, whole: bool) -> None:
        """Start a request's record."""
        self._sent[request_id] = (whole, [])

    def drop(self, request_id: str) -> None:
        """Forget a request that ends without a finished output (a failed step aborted it)."""
        self._sent.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)

    def encode(self, out: RequestOutput) -> OutputDelta:
        """The delta of a request's newest output; a finished request's record is dropped."""
        rid = out.request_id
        whole, sent = self._sent.get(rid) or (True, [])
        deltas = []
        for pos, o in enumerate(out.outputs):
            n_tok, text, n_lp = sent[pos] if pos < len(sent) and not whole else (0, "", 0)
            keep_text = len(text) if o.text.startswith(text) else 0
            lps = o.logprobs
            deltas.append(
                SeqDelta(
                    o.index,
                    n_tok,
                    o.token_ids[n_tok:],
                    keep_text,
                    o.text[keep_text:],
                    n_lp,
                    pack_logprobs(lps[n_lp:]) if lps is not None else None,
                    o.cumulative_logprob,
                    o.finish_reason,
                    o.stop_reason,
                )
            )
            entry = (len(o.token_ids), o.text, len(lps) if lps is not None else 0)
            if pos < len(sent):
                sent[pos] = entry
            else:
                sent.append(entry)
        keep_plp = self._prompt_logprobs.get(rid, 0)
        plp = out.prompt_logprobs
        if plp is not None:
            self._prompt_logprobs[rid] = len(plp)
            plp = plp[keep_plp:]
        if out.finished:
            self._sent.pop(rid, None)
            self._prompt_logprobs.pop(rid, None)
        return OutputDelta(
            rid, deltas, out.finished, out.error, out.error_kind, keep_plp, pack_logprobs(plp), out.metrics
        )


class DeltaDecoder:
    """The server's side: rebuilds each request's cumulative RequestOutput from its deltas. `add` runs before
    the request is sent; `decode` and `drop` run in the order the core's messages arrive (one thread)."""

    def __init__(self) -> None:
        # request id -> (prompt text, prompt ids, the last output built)
        self._requests: dict[str, tuple[str | None, list[int], RequestOutput | None]] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        """Start a request's record."""
        self._requests[request_id] = (prompt, prompt_token_ids, None)

    def drop(self, request_id: str) -> None:
        """Forget a request that ended without a finished output (refused, or failed)."""
        self._requests.pop(request_id, None)

    def decode(self, d: OutputDelta) -> RequestOutput | None:
        """The request's output as of this delta (None for a request not known here)."""
        record = self._requests.get(d.request_id)
        if record is None:
            return None
        prompt, prompt_ids, last = record
        before = last.outputs if last is not None else []
        outputs = []
        for pos, s in enumerate(d.outputs):
            prev = before[pos] if pos < len(before) else None
            tokens, text, lps = s.token_ids, s.text, unpack_logprobs(s.logprobs)
            if prev is not None:
                tokens = prev.token_ids[: s.keep_tokens] + tokens if s.keep_tokens else tokens
                text = prev.text[: s.keep_text] + text if s.keep_text else text
                if lps is not None and s.keep_logprobs and prev.logprobs is not None:
                    lps = prev.logprobs[: s.keep_logprobs] + lps
            outputs.append(
                CompletionOutput(
                    s.index, text, tokens, s.cumulative_logprob, lps, s.finish_reason, s.stop_reason
                )
            )
        plp = unpack_logprobs(d.prompt_logprobs)
        if plp is not None and d.keep_prompt_logprobs and last is not None and last.prompt_logprobs:
            plp = last.prompt_logprobs[: d.keep_prompt_logprobs] + plp
        out = RequestOutput(
            d.request_id, prompt, prompt_ids, outputs, d.finished, d.error, d.error_kind, plp, d.metrics
        )  # type: ignore[arg-type]
        if d.finished:
            del self._requests[d.request_id]
        else:
            self._requests[d.request_id] = (prompt, prompt_ids, out)
        return out


class Channel:
    """One end of the pipe pair between the two processes: a thread that reads whole messages and hands each to
    `on_message` (then `on_close` once the other end is gone), and a thread that writes what `send` queues, so
    that neither side's work waits on the other's reads."""

    def __init__(
        self,
        receive: Connection,
        send: Connection,
        on_message: Callable[[bytes], None],
        on_close: Callable[[], None],
        name: str,
    ) -> None:
        self._receive, self._send = receive, send
        self._on_message, self._on_close = on_message, on_close
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name=f"{name}-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    def send(self, data: bytes) -> None:
        """Queue a message (from any thread)."""
        self._outbox.put(data)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (for at most `timeout` seconds), then close the sending end."""
        self._outbox.put(None)
        self._writer.join(timeout)

    def _read(self) -> None:
        try:
            while True:
                data = self._receive.recv_bytes()
                self._on_message(data)
        except (EOFError, OSError):
            pass
        except Exception:
            logger.exception("reading from the engine pipe")
        finally:
            self._on_close()

    def _write(self) -> None:
        try:
            while (data := self._outbox.get()) is not None:
                self._send.send_bytes(data)
        except OSError:
            pass  # the other end is gone: its reader says so
        finally:
            self._send.close()
