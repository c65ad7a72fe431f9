"""The engine as its clients see it (the HTTP server, `LLM`'s async users, tests): `EngineClient`, one class over
two transports, as vLLM v1's core client is. No torch behind it, so the server never touches tensors.

The client holds what serving a request means whatever carries it: the serving verdict (dead, shut down,
stalled), each request's stream, the requests sent but not yet applied (they count as waiting), the step
listeners, the queries (a KV-cache snapshot, an integrity check, a grammar compile), and what a stall or a
death fails. A `Transport` carries requests to the engine and reports back through the client's narrow sink
(`on_outputs`, `on_failed`, `on_death`); it does nothing else. Two implement it: in this process, an LLMEngine
stepped in a thread (`AsyncEngine`, async_engine.py), or an engine core in a child process over pipes
(`ProcessEngine`, process_engine.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from tinypaged import limits
from tinypaged.config import STALL_TIMEOUT_S, EngineConfig
from tinypaged.engine.frontend.liveness import Watchdog
from tinypaged.engine.frontend.streams import Streams
from tinypaged.engine.request import EngineRequest, Prompt
from tinypaged.engine.step.stats import EngineSnapshot, EngineStats, StepStats
from tinypaged.errors import EngineDeadError, EngineError, RequestError
from tinypaged.outputs import RequestOutput
from tinypaged.sampling_params import SamplingParams, StructuredOutputsParams
from tinypaged.tokenizer import Tokenizer

__all__ = ["EngineClient", "Sink", "Transport"]

T = TypeVar("T")


class Sink(Protocol):
    """What a transport reports, on the event loop: outputs, failures, death."""

    def on_outputs(self, outputs: list[RequestOutput], step: StepStats | None, applied: int) -> None:
        """Outputs of a step (`step` its statistics) or of aborts applied between steps (`step` None);
        `applied`: how many of the requests sent the engine has added (or refused) so far."""
        ...

    def on_failed(self, request_ids: list[str], error: Exception) -> None:
        """These requests ended on `error` (refused by the engine, or taken down by a failed step)."""
        ...

    def on_death(self, why: str) -> None:
        """The engine cannot go on: every request fails, and every new one."""
        ...


class Transport(Protocol):
    """How a client reaches its engine: starts it, carries requests, aborts and queries to it, and says why it
    is stalled. A query's answer is an asyncio future the transport settles on the event loop (a result or an
    exception); the client fails it if the engine stalls, dies or stops first."""

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        ...

    @property
    def core_pid(self) -> int | None:
        """The engine core's process id (None: it runs in this process)."""
        ...

    def process_inputs(self, request_id: str, prompt: Prompt, params: SamplingParams) -> EngineRequest:
        """Check and tokenize a request (RequestError naming the parameter); nothing is sent."""
        ...

    def start(self, sink: Sink) -> None:
        """Start carrying on the running event loop, reporting to `sink`."""
        ...

    def add(self, request: EngineRequest) -> None:
        """Send a checked request; the engine adds it (or refuses it: `Sink.on_failed`) between two steps."""
        ...

    def abort(self, request_id: str) -> None:
        """Send an abort; the request's finished output comes back through `Sink.on_outputs`."""
        ...

    def stats(self) -> EngineStats:
        """The engine's load as this side knows it (requests not yet applied left out)."""
        ...

    def snapshot(self, answer: asyncio.Future[EngineSnapshot]) -> None:
        """Ask for the KV cache's blocks and the stats, taken between two steps."""
        ...

    def check_integrity(self, answer: asyncio.Future[None]) -> None:
        """Ask for the KV cache manager's invariants checked between two steps (AssertionError if broken)."""
        ...

    def compile_grammar(self, spec: StructuredOutputsParams, answer: asyncio.Future[None]) -> None:
        """Ask for a grammar compiled where it runs (RequestError naming the parameter if the spec is at
        fault); an answer cancelled (too slow) may cancel the compile."""
        ...

    def why_stalled(self, timeout: float) -> str | None:
        """Why the engine is stalled (no step for `timeout` while it has work, or silent), None if it is not."""
        ...

    async def stop(self, stalled: bool) -> None:
        """Stop the engine after its step in flight (`stalled`: it may never finish one) and release it."""
        ...


class EngineClient:
    """Submit requests and stream their outputs; start, stop and observe the engine: `await start()`,
    `async for out in generate(...)`, `await shutdown()`. `stall_timeout`: seconds without a step while the
    engine has work before it is declared stalled (0 or None: never). Build it as `AsyncEngine` (in this
    process) or `ProcessEngine` (an engine-core process)."""

    def __init__(
        self, config: EngineConfig, transport: Transport, stall_timeout: float | None = STALL_TIMEOUT_S
    ) -> None:
        self._config = config
        self._transport = transport
        self._streams = Streams(transport.abort)
        self._started = False
        self._stopped = False
        self._dead: str | None = None  # why the engine died, if it did
        self._step_listeners: list[Callable[[StepStats], None]] = []
        self._queries: set[asyncio.Future[Any]] = set()  # answers not yet given
        # Requests sent but not yet applied by the engine (it counts those it applied): (number, sequences).
        self._sent = 0
        self._unapplied: deque[tuple[int, int]] = deque()
        self._watchdog = Watchdog(stall_timeout, transport.why_stalled, self._on_stall)

    # ---- what the server reads ----------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration (model shape, limits)."""
        return self._config

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self._transport.tokenizer

    @property
    def core_pid(self) -> int | None:
        """The engine core's process id when it runs in a process of its own (None: in this one)."""
        return self._transport.core_pid

    @property
    def is_running(self) -> bool:
        """True between start() and shutdown() while the engine serves (not failed)."""
        return self._started and not self._stopped and self._dead is None

    @property
    def unavailable(self) -> str | None:
        """Why the engine cannot serve now: not started, shut down, dead, or stalled (no step for the stall
        timeout while it has work, or a core process silent that long); None while it serves."""
        if self._dead is not None:
            return self._dead
        if self._stopped:
            return "the engine has been shut down"
        if not self._started:
            return "the engine has not started"
        return self._watchdog.stalled

    def stats(self) -> EngineStats:
        """Queue lengths, cache usage, preemptions and token counters (as of the engine's last report);
        requests sent but not yet applied count as waiting."""
        stats = self._transport.stats()
        if not self._unapplied:
            return stats
        return replace(
            stats,
            num_waiting=stats.num_waiting + len(self._unapplied),
            num_waiting_seqs=stats.num_waiting_seqs + sum(n for _, n in self._unapplied),
        )

    def add_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        """Call `listener` with each step's statistics, on the event loop, as the step's outputs arrive."""
        self._step_listeners.append(listener)

    async def snapshot(self) -> EngineSnapshot:
        """The KV cache's blocks (ref counts, prefix-cache blocks, holders' request ids) and the stats, taken
        between two steps; EngineError if the engine stops first."""
        return await self._ask(self._transport.snapshot)

    async def check_integrity(self) -> None:
        """The KV cache manager's invariants, checked between two steps (AssertionError if broken)."""
        await self._ask(self._transport.check_integrity)

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar (structured outputs) where the engine runs, off the event loop, once
        per distinct grammar; RequestError naming the parameter if it is invalid, unsupported or too slow to
        compile. Awaited before `generate`, a bad grammar is refused before anything is queued."""
        spec = params.structured_outputs
        if spec is None:
            return
        try:
            await asyncio.wait_for(
                self._ask(lambda answer: self._transport.compile_grammar(spec, answer)),
                limits.GRAMMAR_COMPILE_TIMEOUT_S,
            )
        except TimeoutError as e:
            raise RequestError(
                f"the {spec.kind} did not compile within {limits.GRAMMAR_COMPILE_TIMEOUT_S} s",
                f"structured_outputs.{spec.kind}",
            ) from e

    # ---- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start serving on the running event loop (idempotent)."""
        self._start()

    def _start(self) -> None:
        if self._stopped:
            raise EngineError("the engine has been shut down")
        if self._started:
            return
        self._started = True
        self._transport.start(self)
        self._watchdog.start()

    async def shutdown(self) -> None:
        """Stop the engine (after the step in flight); unfinished requests fail with EngineError."""
        if self._stopped:
            return
        self._start()  # (an engine never started is stopped the same way)
        self._stopped = True
        self._watchdog.stop()
        self._fail_all(EngineError, "the engine was shut down")
        await self._transport.stop(stalled=self._watchdog.stalled is not None)

    # ---- requests -------------------------------------------------------------------------------------

    def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str, client_request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue the request now; stream its cumulative RequestOutput after each step it advanced in (the
        newest only, when several wait for a slow consumer), the last one finished. `client_request_id`: the
        client request it is one prompt of (the scheduler's admission takes turns between client requests);
        None, a client request of its own.

        Checked and sent when called (RequestError naming the parameter if the engine will not run it; nothing
        is queued then), so a caller's admission check and the queueing happen without an await between them.
        Closing or cancelling the stream, or dropping it unread (a client gone), aborts the request. A failure
        inside the engine raises EngineError from the stream.
        """
        self._check_serving()
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use")
        request = self._transport.process_inputs(request_id, prompt, params)
        if client_request_id is not None:
            request = replace(request, client_request_id=client_request_id)
        self._start()
        stream = self._streams.open(request_id)
        self._sent += 1
        self._unapplied.append((self._sent, params.num_seqs))
        self._transport.add(request)
        return stream

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a finished output (finish_reason "abort")."""
        if request_id in self._streams:
            self._transport.abort(request_id)

    def _check_serving(self) -> None:
        """EngineDeadError if the engine died (why) or is stalled (why; it may move again), EngineError if it
        was shut down."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._stopped:
            raise EngineError("the engine has been shut down")
        if self._watchdog.stalled is not None:
            raise EngineDeadError(self._watchdog.stalled)

    async def _ask(self, query: Callable[[asyncio.Future[T]], None]) -> T:
        """Ask the engine `query`; its answer (EngineDeadError if the engine stalls or dies first, EngineError
        if it is shut down)."""
        self._check_serving()
        self._start()
        answer: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queries.add(answer)
        try:
            query(answer)
            return await answer  # (cancelled with its asker: the transport sees it done and skips it)
        finally:
            self._queries.discard(answer)

    # ---- the sink: what the transport reports, on the event loop -------------------------------------

    def on_outputs(self, outputs: list[RequestOutput], step: StepStats | None, applied: int) -> None:
        """Hand outputs to their streams, and a step's statistics to the listeners."""
        unapplied = self._unapplied
        while unapplied and unapplied[0][0] <= applied:
            unapplied.popleft()
        self._streams.dispatch(outputs)
        if step is not None:
            for listener in self._step_listeners:
                listener(step)

    def on_failed(self, request_ids: list[str], error: Exception) -> None:
        """End these requests' streams with `error`."""
        self._streams.fail(request_ids, error)

    def on_death(self, why: str) -> None:
        """The engine died: every open stream and pending query fails with EngineDeadError(why), and every
        new request."""
        if self._dead is not None:
            return
        self._dead = why
        self._watchdog.stop()
        self._fail_all(EngineDeadError, why)

    # ---- liveness -----------------------------------------------------------------------------------

    def _on_stall(self, why: str) -> None:
        """The engine is stalled: its requests and queries fail now, and the requests are aborted (their blocks
        return once it moves again)."""
        ids = self._streams.ids()
        self._fail_all(EngineDeadError, why)
        for rid in ids:
            self._transport.abort(rid)

    def _fail_all(self, error: type[EngineError], why: str) -> None:
        """Fail every open stream and pending query with `error(why)`."""
        self._streams.fail(self._streams.ids(), error(why))
        for answer in self._queries:
            if not answer.done():
                answer.set_exception(error(why))
