"""ProcessEngine: the engine client (client.py) over an engine core running in a process of its own
(core_process.py).

This side, in the server's process, checks and tokenizes each request (the same InputProcessor as in-process),
sends it down the pipe, and rebuilds each step's outputs for the client on the event loop. The core steps
without sharing an interpreter lock with the HTTP work: with hundreds of streams, that work took a tenth of the
steps' time when both ran in one process. `tinypaged serve` runs this by default; `--no-engine-process` keeps
the engine in the server's process (`AsyncEngine`).

Liveness: a core that exits is dead (every request fails, and every new one). A core that makes no step for the
stall timeout while it has work, or sends no heartbeat for SILENCE_TIMEOUT_S (stopped, frozen; or the stall
timeout, if shorter), is stalled (liveness.py): the client fails its requests, until it moves again.
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
from collections.abc import Callable
from typing import Any

from tinypaged.config import STALL_TIMEOUT_S, EngineConfig
from tinypaged.engine.frontend.client import EngineClient, Sink
from tinypaged.engine.frontend.core_process import run_core
from tinypaged.engine.frontend.liveness import SILENCE_TIMEOUT_S, heartbeat_interval, stall_message
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
from tinypaged.engine.request import EngineRequest, Prompt
from tinypaged.engine.step.inputs import InputProcessor
from tinypaged.engine.step.stats import EngineSnapshot, EngineStats
from tinypaged.errors import EngineError, RequestError
from tinypaged.outputs import RequestOutput
from tinypaged.sampling_params import SamplingParams, StructuredOutputsParams
from tinypaged.tokenizer import Tokenizer

__all__ = ["CoreProcess", "ProcessEngine"]

logger = logging.getLogger(__name__)

_STOP_WAIT_S = 60.0  # seconds the core gets to stop (its tensor-parallel ranks included) before it is killed
_STALLED_STOP_WAIT_S = 5.0  # the same for a stalled core, which may never read its stop


class ProcessEngine(EngineClient):
    """The engine client over an engine core in a child process, started (and its model loaded) when this is
    built. EngineError, or the core's own error, if it cannot start within `start_timeout` seconds (None: no
    limit). `stall_timeout`: seconds without a step while it has work (or without a heartbeat, up to
    SILENCE_TIMEOUT_S) before the core is declared stalled (0 or None: never)."""

    def __init__(
        self,
        config: EngineConfig,
        start_timeout: float | None = None,
        stall_timeout: float | None = STALL_TIMEOUT_S,
    ) -> None:
        super().__init__(config, CoreProcess(config, start_timeout, stall_timeout), stall_timeout)
        # What exists now (torch, the tokenizer, the server's modules) lives as long as the server: out of the
        # cyclic collector's view, as the engine does in its process, so that the collections a burst of outputs
        # triggers traverse only the outputs.
        gc.collect()
        gc.freeze()


class CoreProcess:
    """The core-process transport (client.Transport): spawns the core, writes to it and reads it through a
    Channel (wire.py), rebuilds its outputs (DeltaDecoder), and hears its heartbeats."""

    def __init__(
        self, config: EngineConfig, start_timeout: float | None, stall_timeout: float | None
    ) -> None:
        self._tokenizer = Tokenizer(config.tokenizer_path)
        # Grammars compile in the core (where they run); here a request is checked and tokenized only.
        self._inputs = InputProcessor(config, self._tokenizer, None)
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: CUDA does not survive a fork
        ops_read, self._ops = ctx.Pipe(duplex=False)
        self._results, results_write = ctx.Pipe(duplex=False)
        log_level = logging.getLogger().getEffectiveLevel()
        self._process = ctx.Process(
            target=run_core,
            args=(config, ops_read, results_write, log_level, heartbeat_interval(stall_timeout)),
            name="tinypaged-engine-core",
        )
        self._process.start()
        self._reap_lock = threading.Lock()
        ops_read.close()  # the core's ends: ours closed, so that our reads end when the core does
        results_write.close()
        self._stats = self._wait_ready(start_timeout)
        self._outputs = DeltaDecoder()
        self._channel: Channel | None = None
        self._sink: Sink | None = None
        self._stopping = False
        self._gone = False  # the core died (reported once)
        # Queries asked, by token: their answer and how to read the core's reply.
        self._queries: dict[int, tuple[asyncio.Future[Any], Callable[[Reply], Any]]] = {}
        self._tokens = itertools.count()
        # Liveness, as the reader thread last saw it: when it last heard from the core, and how long the core's
        # main loop had been in its current step at its last heartbeat (`busy_s`; 0 after a step's outputs),
        # with when that heartbeat came.
        self._heard_at = time.monotonic()
        self._busy: tuple[float, float] = (0.0, self._heard_at)

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

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (a copy of the core's, in this process)."""
        return self._tokenizer

    @property
    def core_pid(self) -> int | None:
        """The engine-core process's id."""
        return self._process.pid

    def process_inputs(self, request_id: str, prompt: Prompt, params: SamplingParams) -> EngineRequest:
        """The InputProcessor's check and tokenization (no grammar: the core compiles it)."""
        return self._inputs.process(request_id, prompt, params)

    def stats(self) -> EngineStats:
        """The load as of the core's last message."""
        return self._stats

    def add(self, request: EngineRequest) -> None:
        """Register the request's outputs to rebuild, and send it."""
        rid, prompt, ids = request.request_id, request.prompt, request.prompt_token_ids
        self._outputs.add(rid, prompt, ids)
        self._send(("add", rid, prompt, ids, request.params, request.client_request_id))

    def abort(self, request_id: str) -> None:
        """Send the abort."""
        self._send(("abort", request_id))

    def snapshot(self, answer: asyncio.Future[EngineSnapshot]) -> None:
        """Ask the core, which takes it between two steps."""
        self._ask(answer, _snapshot, "snapshot")

    def check_integrity(self, answer: asyncio.Future[None]) -> None:
        """Ask the core, which checks between two steps."""
        self._ask(answer, _integrity, "integrity")

    def compile_grammar(self, spec: StructuredOutputsParams, answer: asyncio.Future[None]) -> None:
        """Ask the core to compile in its grammar pool (where the grammar runs); EngineError if its compile
        failed other than by the spec's fault."""

        def compiled(reply: Reply) -> None:
            if reply.refused:
                raise RequestError(reply.error or "", reply.param, reply.code)
            if reply.error is not None:  # not the spec's fault: this request fails alone, as a 500
                raise EngineError(f"compiling the {spec.kind} failed: {reply.error}")

        self._ask(answer, compiled, "compile", spec)

    def why_stalled(self, timeout: float) -> str | None:
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

    def _send(self, op: tuple[Any, ...]) -> None:
        if self._channel is not None and not self._stopping and not self._gone:
            self._channel.send(pickle.dumps(op, protocol=pickle.HIGHEST_PROTOCOL))

    def _ask(self, answer: asyncio.Future[Any], read: Callable[[Reply], Any], kind: str, *args: Any) -> None:
        """Send query `kind`; `read(reply)` answers it (or raises the error to answer with)."""
        token = next(self._tokens)
        self._queries[token] = (answer, read)
        answer.add_done_callback(lambda _: self._queries.pop(token, None))
        self._send((kind, token, *args))

    # ---- lifecycle ------------------------------------------------------------------------------------

    def start(self, sink: Sink) -> None:
        """Start reading the core's messages, for the running event loop."""
        loop = asyncio.get_running_loop()
        self._sink = sink

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

    async def stop(self, stalled: bool) -> None:
        """Tell the core to stop and wait for it to exit (it is killed if it does not, soon)."""
        assert self._channel is not None
        self._channel.send(pickle.dumps(("stop",)))
        self._stopping = True
        self._channel.close()
        wait = _STALLED_STOP_WAIT_S if stalled else _STOP_WAIT_S
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

    # ---- the core's messages, on the event loop ----------------------------------------------------------

    def _on_message(self, msg: Message, outputs: list[RequestOutput]) -> None:
        sink = self._sink
        assert sink is not None
        if isinstance(msg, Outputs):
            self._stats = msg.stats
            sink.on_outputs(outputs, msg.step, msg.applied)
        elif isinstance(msg, Failed):
            error: Exception = (
                RequestError(msg.message, msg.param, msg.code) if msg.refused else EngineError(msg.message)
            )
            sink.on_failed(msg.request_ids, error)
        elif isinstance(msg, Reply):
            query = self._queries.get(msg.token)
            if query is not None and not query[0].done():
                answer, read = query
                try:
                    answer.set_result(read(msg))
                except Exception as e:  # noqa: BLE001 - the asker's error
                    answer.set_exception(e)
        elif isinstance(msg, Dead):
            self._die(msg.message)

    def _core_gone(self) -> None:
        """The core's end of the pipe closed: an exit we asked for, or a death."""
        if not self._stopping:
            self._die(f"the engine process exited (code {self._process.exitcode})")

    def _die(self, why: str) -> None:
        if self._gone:
            return
        self._gone = True
        logger.error("engine core stopped: %s", why)
        assert self._sink is not None
        self._sink.on_death(why)


def _snapshot(reply: Reply) -> EngineSnapshot:
    if reply.error is not None:
        raise EngineError(f"taking the KV cache snapshot failed: {reply.error}")
    return pickle.loads(reply.result)


def _integrity(reply: Reply) -> None:
    if reply.error is not None:
        raise AssertionError(reply.error)
