"""The engine core in a process of its own (vLLM v1's EngineCore): `run_core` is that process's main.

Its main thread owns the LLMEngine and runs steps back to back while there is work; between two steps it
applies what the server sent (requests, aborts, queries), and after each step it sends the step's outputs as
one message (wire.py). The HTTP work of hundreds of streams then runs in the server's process, beside this
one, instead of sharing its interpreter lock with the steps. `CoreProcess` (process_engine.py), the engine
client's transport, is the other end. A thread of its own beats a heartbeat saying how long the main loop has
been in its current step, so that the server tells a stalled step, or a frozen process, from a slow step
(liveness.py).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from tinypaged.config import EngineConfig
from tinypaged.engine.frontend.liveness import death_message
from tinypaged.engine.frontend.wire import (
    Beat,
    Channel,
    Dead,
    DeltaEncoder,
    Failed,
    Outputs,
    Ready,
    Reply,
    encode,
)
from tinypaged.engine.request import EngineRequest
from tinypaged.engine.step.llm_engine import LLMEngine
from tinypaged.engine.step.queued_step import StepError
from tinypaged.errors import RequestError
from tinypaged.outputs import RequestOutput

if TYPE_CHECKING:
    from tinypaged.engine.step.stats import StepStats

logger = logging.getLogger(__name__)

_EXIT_GRACE_S = 60.0  # seconds to stop in once the server's end of the pipe is closed
# Seconds between two readings of the engine's load while it steps with nothing new applied. A reading walks the
# waiting queue (0.3 ms with 2,000 requests waiting, on a CPU core), too much for every step; between readings the
# waiting requests can only be admitted (the server's view of the queue stays an overestimate).
_STATS_EVERY_S = 0.05


class _Inbox:
    """What the server sent, in order, until the main thread takes it between two steps."""

    def __init__(self) -> None:
        self._ops: deque[tuple[Any, ...]] = deque()
        self._ready = threading.Event()

    def put(self, data: bytes) -> None:
        self._ops.append(pickle.loads(data))
        self._ready.set()

    def close(self) -> None:
        self._ops.append(("stop",))  # the server's end is gone: stop as if told to
        self._ready.set()

    def take(self, block: bool) -> list[tuple[Any, ...]]:
        """Everything queued; with `block`, wait for something first."""
        if block:
            self._ready.wait()
        self._ready.clear()
        ops = []
        while self._ops:
            ops.append(self._ops.popleft())
        return ops


def run_core(
    config: EngineConfig, ops: Connection, results: Connection, log_level: int, beat_every: float
) -> None:
    """The engine-core process: build the engine, serve the server's requests until told to stop (or until the
    server's end of the pipe closes), shut the engine down, with a heartbeat every `beat_every` seconds from
    its start of serving. Exits non-zero if the engine failed."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(message)s")
    # Ctrl-C and a service manager's SIGTERM reach the whole process group: the server drains its requests
    # and then stops this process through the pipe (or its end closes, if it dies).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbox = _Inbox()

    def server_gone() -> None:
        inbox.close()
        # A step stuck on a lost tensor-parallel rank would keep this process, and its GPU, forever.
        timer = threading.Timer(_EXIT_GRACE_S, os._exit, (1,))
        timer.daemon = True
        timer.start()

    channel = Channel(ops, results, inbox.put, server_gone, "tinypaged-core")
    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - the server says why it could not start
        channel.send(encode(Dead(str(e) or type(e).__name__, _pickled(e))))
        channel.close()
        os._exit(1)

    def group_failed(why: str) -> None:  # from the executor's monitor thread; a step may be stuck on it
        channel.send(encode(Dead(f"the engine has stopped: {why}")))

    engine.executor.on_failure(group_failed)
    channel.send(encode(Ready(engine.stats())))
    core = _Core(engine, channel)
    threading.Thread(target=core.beat, args=(beat_every,), name="tinypaged-heartbeat", daemon=True).start()
    code = core.serve(inbox)
    try:
        engine.shutdown()
    finally:
        channel.close()
        os._exit(code)


def _pickled(e: BaseException) -> bytes:
    try:
        return pickle.dumps(e)
    except Exception:  # noqa: BLE001 - an exception that does not pickle goes by its message
        return b""


class _Core:
    """The main thread's loop over one engine."""

    def __init__(self, engine: LLMEngine, channel: Channel) -> None:
        self.engine = engine
        self.channel = channel
        self.deltas = DeltaEncoder()
        self.applied = 0  # requests added so far
        self._stats = engine.stats()  # the load as last read (_send)
        self._stats_due = 0.0
        # When the main loop began its current pass (applying what arrived, then one step); None while it waits
        # for work. The heartbeat thread reads it.
        self.busy_since: float | None = None

    def beat(self, every: float) -> None:
        """The heartbeat thread: how long the main loop has been in its current pass, every `every` seconds.
        A thread of its own, so that the beat goes on while a step runs (a step stuck in a call that lets go
        of the interpreter lock shows as a growing `busy_s`; a frozen process, as no beat at all)."""
        while True:
            time.sleep(every)
            since = self.busy_since
            self.channel.send(encode(Beat(0.0 if since is None else time.monotonic() - since)))

    def serve(self, inbox: _Inbox) -> int:
        """Apply what arrives and step while there is work; 0 once told to stop, 1 if the engine died."""
        engine = self.engine
        try:
            while True:
                idle = not engine.has_unfinished_requests()
                if idle:
                    self.busy_since = None
                ops = inbox.take(block=idle)
                self.busy_since = time.monotonic()
                if ops and not self._apply(ops):
                    return 0
                if engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:
            # The scheduler's state is unknown after an error outside a step's model work: stop serving.
            self.channel.send(encode(Dead(death_message(e, "engine core"))))
            return 1

    def _step(self) -> None:
        engine = self.engine
        try:
            result = engine.step()
        except StepError as e:
            logger.error("%s (requests %s)", e, e.request_ids, exc_info=e.__cause__)
            for rid in e.request_ids:
                self.deltas.drop(rid)  # aborted: no output of theirs follows
            self.channel.send(encode(Failed(e.request_ids, str(e), refused=False)))
            self._send(e.outputs)
            return
        self._send(result.outputs, result.stats)

    def _send(self, outputs: list[RequestOutput], step: StepStats | None = None) -> None:
        """Send outputs with the engine's load: read afresh after applying requests and aborts (`step` None),
        once the engine is idle, and otherwise every _STATS_EVERY_S."""
        now = time.monotonic()
        if step is None or now >= self._stats_due or not self.engine.has_unfinished_requests():
            self._stats, self._stats_due = self.engine.stats(), now + _STATS_EVERY_S
        encode_delta = self.deltas.encode
        deltas = [encode_delta(out) for out in outputs]
        self.channel.send(encode(Outputs(self.applied, deltas, self._stats, step)))

    def _apply(self, ops: list[tuple[Any, ...]]) -> bool:
        """Apply requests, aborts and queries in order; False on a stop."""
        engine, outputs = self.engine, []
        for op in ops:
            kind = op[0]
            if kind == "stop":
                return False
            if kind == "add":
                _, request_id, prompt, ids, params, client_request_id = op
                self.applied += 1
                spec = params.structured_outputs
                grammar = engine.grammars.start(spec) if spec is not None else None
                try:
                    engine.add(EngineRequest(request_id, prompt, ids, params, grammar, client_request_id))
                except RequestError as e:
                    self.channel.send(encode(Failed([request_id], str(e), True, e.param, e.code)))
                    continue
                self.deltas.add(request_id, whole=params.use_beam_search or params.num_seqs > params.n)
            elif kind == "abort":
                out = engine.abort_request(op[1])
                if out is not None:
                    outputs.append(out)
            else:
                self._query(kind, op[1], *op[2:])
        self._send(outputs)
        return True

    def _query(self, kind: str, token: int, *args: Any) -> None:
        """Answer a query; a grammar compile answers when it is done (the compile pool's thread sends it)."""
        send = self.channel.send
        if kind == "compile":
            future = self.engine.grammars.submit(args[0])

            def compiled(f: Any) -> None:
                send(encode(_reply(token, f.exception)))

            future.add_done_callback(compiled)
            return
        if kind == "snapshot":
            send(encode(_reply(token, lambda: pickle.dumps(self.engine.snapshot()))))
        elif kind == "integrity":
            send(encode(_reply(token, lambda: self.engine.check_integrity())))
        else:
            raise ValueError(f"unknown operation {kind!r}")


def _reply(token: int, answer: Any) -> Reply:
    """Reply with what `answer()` returns (bytes), or the error it raises; an exception it returns is an error
    too (a future's `exception`)."""
    try:
        result = answer()
    except BaseException as e:  # noqa: BLE001 - the query's asker gets the error
        result = e
    if isinstance(result, RequestError):
        return Reply(token, error=str(result), refused=True, param=result.param, code=result.code)
    if isinstance(result, BaseException):
        return Reply(token, error=str(result) or type(result).__name__)
    return Reply(token, result=result if isinstance(result, bytes) else b"")
