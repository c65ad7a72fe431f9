"""ProcessEngine: the `EngineClient` of an engine core running in a process of its own (core_process.py).

This side, in the server's process, checks and tokenizes each request (the same InputProcessor as in-process),
sends it down the pipe, and rebuilds each step's outputs into the requests' streams on the event loop. The
core steps without sharing an interpreter lock with the HTTP work: with hundreds of streams, that work took a
tenth of the steps' time when both ran in one process. `tinypaged serve` runs this by default;
`--no-engine-process` keeps the engine in the server's process (`AsyncEngine`).

Liveness: a core that exits is dead (every request fails, and every new one). A core that makes no step for the
stall timeout while it has work, or sends no heartbeat for SILENCE_TIMEOUT_S (stopped, frozen; or the stall
timeout, if shorter), is stalled (liveness.py): its requests fail and are aborted, new ones are refused, until it
moves again.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import multiprocessing
import pickle
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from typing import Any

from tinypaged import limits
from tinypaged.config import STALL_TIMEOUT_S, EngineConfig
from tinypaged.engine.frontend.client import check_serving
from tinypaged.engine.frontend.core_process import run_core
from tinypaged.engine.frontend.liveness import (
    SILENCE_TIMEOUT_S,
    Watchdog,
    heartbeat_interval,
    stall_message,
)
from tinypaged.engine.frontend.streams import Streams
from tinypaged.engine.frontend.wire import (
    Beat,
    Channel,
    Dead,
    DeltaDecoder,
    Failed,
    Message,
    Outputs,
    Ready,
    Reply,
    decode,
)
from tinypaged.engine.request import Prompt
from tinypaged.engine.step.inputs import InputProcessor
from tinypaged.engine.step.stats import EngineSnapshot, EngineStats, StepStats
from tinypaged.errors import EngineDeadError, EngineError, RequestError
from tinypaged.outputs import RequestOutput
from tinypaged.sampling_params import SamplingParams
from tinypaged.tokenizer import Tokenizer

__all__ = ["ProcessEngine"]

logger = logging.getLogger(__name__)

_STOP_WAIT_S = 60.0  # seconds the core gets to stop (its tensor-parallel ranks included) before it is killed
_STALLED_STOP_WAIT_S = 5.0  # the same for a stalled core, which may never read its stop


class ProcessEngine:
    """An engine core in a child process, started (and its model loaded) when this is built: `await start()`,
    `async for out in generate(...)`, `await shutdown()`. EngineError, or the core's own error, if it cannot
    start. `stall_timeout`: seconds without a step while it has work (or without a heartbeat, up to
    SILENCE_TIMEOUT_S) before the core is declared stalled (0 or None: never)."""

    def __init__(
        self,
        config: EngineConfig,
        start_timeout: float | None = None,
        stall_timeout: float | None = STALL_TIMEOUT_S,
    ) -> None:
        self._config = config
        self._tokenizer = Tokenizer(config.model)
        # Grammars compile in the core (where they run); here a request is checked and tokenized only.
        self._inputs = InputProcessor(config, self._tokenizer, None)
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: CUDA does not survive a fork
        ops_read, self._ops = ctx.Pipe(duplex=False)
        self._results, results_write = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=run_core,
            args=(
                config,
                ops_read,
                results_write,
                logging.getLogger().getEffectiveLevel(),
                heartbeat_interval(stall_timeout),
            ),
            name="tinypaged-engine-core",
        )
        self._process.start()
        self._reap_lock = threading.Lock()
        ops_read.close()  # the core's ends: ours closed, so that our reads end when the core does
        results_write.close()
        self._stats = self._wait_ready(start_timeout)
        self._streams = Streams(lambda request_id: self._send(("abort", request_id)))
        self._outputs = DeltaDecoder()
        self._channel: Channel | None = None
        self._dead: str | None = None
        self._stopped = False
        self._step_listeners: list[Callable[[StepStats], None]] = []
        self._queries: dict[int, asyncio.Future[Reply]] = {}
        self._tokens = itertools.count()
        # Requests sent but not yet added by the core (it counts those it added): (number, sequences).
        self._sent = 0
        self._unapplied: deque[tuple[int, int]] = deque()
        # Liveness, as the reader thread last saw it: when it last heard from the core, and how long the core's
        # main loop had been in its current step at its last heartbeat (`busy_s`; 0 after a step's outputs),
        # with when that heartbeat came.
        self._heard_at = time.monotonic()
        self._busy: tuple[float, float] = (0.0, self._heard_at)
        self._watchdog = Watchdog(stall_timeout, self._why_stalled, self._on_stall)
        # What exists now (torch, the tokenizer, the server's modules) lives as long as the server: out of the
        # cyclic collector's view, as the engine does in its process, so that the collections a burst of outputs
        # triggers traverse only the outputs.
        gc.collect()
        gc.freeze()

    def _wait_ready(self, timeout: float | None) -> EngineStats:
        """Wait for the core to load its model; its error if it could not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._results.poll(0.5):
            if not self._process.is_alive():
                raise EngineError(f"the engine process exited with code {self._process.exitcode}")
            if deadline is not None and time.monotonic() > deadline:
                self._process.kill()
                raise EngineError(f"the engine process did not start within {timeout:.0f} s")
        try:
            msg = decode(self._results.recv_bytes())
        except EOFError:
            self._process.join(10)
            raise EngineError(f"the engine process exited with code {self._process.exitcode}") from None
        if isinstance(msg, Dead):
            self._process.join(10)
            if msg.exception:
                raise pickle.loads(msg.exception)
            raise EngineError(msg.message)
        assert isinstance(msg, Ready)
        return msg.stats

    # ---- what the server reads ----------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration."""
        return self._config

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (a copy of the core's, in this process)."""
        return self._tokenizer

    @property
    def core_pid(self) -> int | None:
        """The engine-core process's id."""
        return self._process.pid

    @property
    def is_running(self) -> bool:
        """True between start() and shutdown() while the core serves."""
        return self._channel is not None and not self._stopped and self._dead is None

    @property
    def unavailable(self) -> str | None:
        """Why the engine cannot serve now (not started, shut down, dead, stalled); None while it serves."""
        if self._dead is not None:
            return self._dead
        if self._stopped:
            return "the engine has been shut down"
        if self._channel is None:
            return "the engine has not started"
        return self._watchdog.stalled

    def stats(self) -> EngineStats:
        """The load as of the core's last message; requests sent but not yet added count as waiting."""
        stats = self._stats
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
        """The KV cache's blocks and the stats, taken by the core between two steps."""
        return pickle.loads((await self._query("snapshot")).result)

    async def check_integrity(self) -> None:
        """The core's KV cache manager's invariants, checked between two steps (AssertionError if broken)."""
        reply = await self._query("integrity")
        if reply.error is not None:
            raise AssertionError(reply.error)

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar (structured outputs) in the core's grammar pool, once per distinct
        grammar; RequestError naming the parameter if it is invalid, unsupported or too slow to compile,
        EngineError if its compile failed otherwise."""
        spec = params.structured_outputs
        if spec is None:
            return
        try:
            reply = await asyncio.wait_for(self._query("compile", spec), limits.GRAMMAR_COMPILE_TIMEOUT_S)
        except TimeoutError as e:
            raise RequestError(
                f"the {spec.kind} did not compile within {limits.GRAMMAR_COMPILE_TIMEOUT_S} s",
                f"structured_outputs.{spec.kind}",
            ) from e
        if reply.refused:
            raise RequestError(reply.error or "", reply.param, reply.code)
        if reply.error is not None:  # not the spec's fault: this request fails alone, as a 500
            raise EngineError(f"compiling the {spec.kind} failed: {reply.error}")

    # ---- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start reading the core's messages on the running event loop (idempotent)."""
        self._start()

    def _start(self) -> None:
        if self._stopped:
            raise EngineError("the engine has been shut down")
        if self._channel is not None:
            return
        loop = asyncio.get_running_loop()

        def on_message(data: bytes) -> None:
            # In the reader thread: decode and rebuild the outputs here, deliver them on the loop. A heartbeat
            # stays here: the watchdog reads what it says.
            self._heard_at = now = time.monotonic()
            msg = decode(data)
            if isinstance(msg, Beat):
                self._busy = (msg.busy_s, now)
                return
            outputs: list[RequestOutput] = []
            if isinstance(msg, Outputs):
                if msg.step is not None:
                    self._busy = (0.0, now)  # a step ended: the next heartbeat times the next one
                rebuild = self._outputs.decode
                outputs = [out for d in msg.outputs if (out := rebuild(d)) is not None]
                # (Rebuilding a million logprobs takes seconds here, while the next heartbeats wait in the pipe.)
                self._heard_at = time.monotonic()
            elif isinstance(msg, Failed):
                for rid in msg.request_ids:
                    self._outputs.drop(rid)
            if not loop.is_closed():  # (else nobody is listening any more)
                loop.call_soon_threadsafe(self._on_message, msg, outputs)

        def on_close() -> None:  # the reader thread, once the core's end is closed: its exit is near
            self._reap(5)
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._core_gone)

        self._heard_at = time.monotonic()  # (its heartbeats waited in the pipe until now)
        self._channel = Channel(self._results, self._ops, on_message, on_close, "tinypaged-client")
        self._watchdog.start()

    async def shutdown(self) -> None:
        """Stop the core (after the step in flight) and wait for it to exit; unfinished requests fail with
        EngineError."""
        if self._stopped:
            return
        self._start()  # (a core never started still gets its stop through the pipe's writer)
        assert self._channel is not None
        self._stopped = True
        self._watchdog.stop()
        self._streams.fail(self._streams.ids(), EngineError("the engine was shut down"))
        self._channel.send(pickle.dumps(("stop",)))
        self._channel.close()
        wait = _STOP_WAIT_S if self._watchdog.stalled is None else _STALLED_STOP_WAIT_S
        await asyncio.get_running_loop().run_in_executor(None, self._join, wait)

    def _join(self, wait: float) -> None:
        if self._reap(wait) is None:
            logger.error("the engine process did not stop within %.0f s: killed", wait)
            self._process.kill()
            self._reap(None)

    def _reap(self, timeout: float | None) -> int | None:
        """Wait for the core to exit; its exit code (None if it runs on). One thread at a time: a second
        concurrent wait would find the process reaped and take it for running."""
        with self._reap_lock:
            self._process.join(timeout)
            return self._process.exitcode

    # ---- requests -------------------------------------------------------------------------------------

    def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str, client_request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Check the request and send it now; stream its cumulative RequestOutput after each step it advanced
        in (the newest only, when several wait for a slow consumer); the last is finished.

        RequestError naming the parameter if the engine will not run it (nothing is sent then). Closing or
        cancelling the iterator, or dropping it unread, aborts the request. A failure inside the engine raises
        EngineError.
        """
        self._check_serving()
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use")
        request = self._inputs.process(request_id, prompt, params)
        self._start()
        stream = self._streams.open(request_id)
        self._outputs.add(request_id, request.prompt, request.prompt_token_ids)
        self._sent += 1
        self._unapplied.append((self._sent, params.num_seqs))
        self._send(("add", request_id, request.prompt, request.prompt_token_ids, params, client_request_id))
        return stream

    async def abort(self, request_id: str) -> None:
        """Abort a request; its iterator ends with a finished output (finish_reason "abort")."""
        if request_id in self._streams:
            self._send(("abort", request_id))

    def _check_serving(self) -> None:
        """EngineDeadError if the core died or is stalled, EngineError if it was shut down."""
        check_serving(self._dead, self._stopped, self._watchdog.stalled)

    def _send(self, op: tuple[Any, ...]) -> None:
        if self._channel is not None and not self._stopped and self._dead is None:
            self._channel.send(pickle.dumps(op, protocol=pickle.HIGHEST_PROTOCOL))

    async def _query(self, kind: str, *args: Any) -> Reply:
        """Ask the core; its reply (EngineError if it stops first)."""
        self._check_serving()
        self._start()
        token = next(self._tokens)
        answer: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._queries[token] = answer
        self._send((kind, token, *args))
        try:
            return await answer
        finally:
            self._queries.pop(token, None)

    # ---- the core's messages, on the event loop ----------------------------------------------------------

    def _on_message(self, msg: Message, outputs: list[RequestOutput]) -> None:
        if isinstance(msg, Outputs):
            self._stats = msg.stats
            while self._unapplied and self._unapplied[0][0] <= msg.applied:
                self._unapplied.popleft()
            self._streams.dispatch(outputs)
            if msg.step is not None:
                for listener in self._step_listeners:
                    listener(msg.step)
        elif isinstance(msg, Failed):
            error: Exception = (
                RequestError(msg.message, msg.param, msg.code) if msg.refused else EngineError(msg.message)
            )
            self._streams.fail(msg.request_ids, error)
        elif isinstance(msg, Reply):
            answer = self._queries.get(msg.token)
            if answer is not None and not answer.done():
                answer.set_result(msg)
        elif isinstance(msg, Dead):
            self._die(msg.message)

    def _core_gone(self) -> None:
        """The core's end of the pipe closed: an exit we asked for, or a death."""
        if not self._stopped:
            code = self._process.exitcode
            self._die(f"the engine process exited (code {code})")

    def _die(self, why: str) -> None:
        if self._dead is not None:
            return
        self._dead = why
        self._watchdog.stop()
        logger.error("engine core stopped: %s", why)
        self._fail_all(why)

    def _fail_all(self, why: str) -> None:
        """Fail every open stream and pending query with EngineDeadError(why)."""
        self._streams.fail(self._streams.ids(), EngineDeadError(why))
        for answer in self._queries.values():
            if not answer.done():
                answer.set_exception(EngineDeadError(why))

    # ---- liveness (the watchdog's probe and verdict, on the event loop) ----------------------------------

    def _why_stalled(self, timeout: float) -> str | None:
        """Why the core is stalled, if it is: no message (a heartbeat comes every few tenths of a second) for
        SILENCE_TIMEOUT_S (or `timeout`, if shorter), or a heartbeat saying its main loop has been in one step
        for `timeout`."""
        now = time.monotonic()
        silent, limit = now - self._heard_at, min(timeout, SILENCE_TIMEOUT_S)
        if silent > limit:
            cause = "and sent no heartbeat: stopped, or frozen"
            return stall_message("the engine core", silent, cause, limit)
        busy_s, at = self._busy
        busy = busy_s + now - at if busy_s else 0.0
        if busy > timeout:
            return stall_message("the engine core", busy, "with work: stuck in a step", timeout)
        return None

    def _on_stall(self, why: str) -> None:
        """The core is stalled: its requests fail now and are aborted (their blocks return once it moves)."""
        ids = self._streams.ids()
        self._fail_all(why)
        for rid in ids:
            self._send(("abort", rid))
