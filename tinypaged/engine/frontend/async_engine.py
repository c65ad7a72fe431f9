"""AsyncEngine: the engine client (client.py) over an LLMEngine stepped in a thread of this process.

The event loop owns all engine mutation between steps: the client's adds, aborts and queries are only queued,
waking the loop task, which applies them (taking the snapshots and integrity checks asked for), then runs
`LLMEngine.step()` in a single worker thread (so the event loop keeps accepting and streaming while the model
computes), back to back until an operation is queued, handing each step's outputs to the client as the step
completes. A step never races with an add, an abort or a query. A step thread that makes no step for the stall
timeout is stalled (liveness.py): the client fails its requests, until it steps again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tinypaged.config import STALL_TIMEOUT_S, EngineConfig
from tinypaged.engine.frontend.client import EngineClient, Sink
from tinypaged.engine.frontend.liveness import death_message, stall_message
from tinypaged.engine.request import EngineRequest, Prompt
from tinypaged.engine.sampling.structured import wait
from tinypaged.engine.step.llm_engine import LLMEngine
from tinypaged.engine.step.queued_step import StepError
from tinypaged.engine.step.stats import EngineSnapshot, EngineStats, StepResult
from tinypaged.errors import EngineDeadError, EngineError, RequestError
from tinypaged.sampling_params import SamplingParams, StructuredOutputsParams
from tinypaged.tokenizer import Tokenizer

__all__ = ["AsyncEngine", "StepThread"]

logger = logging.getLogger(__name__)

# ("add", EngineRequest), ("abort", request_id), ("snapshot" or "integrity", the answer to set): applied in order
# between steps.
_Op = tuple[str, Any]


class _GroupFailed(EngineDeadError):
    """The tensor-parallel group failed while a step was still waiting on it."""


class AsyncEngine(EngineClient):
    """The engine client over an LLMEngine in this process (`engine`, built from `config` unless one is passed
    in: tests share one model load; it must be idle, and it is its owner's to shut down). `stall_timeout`:
    seconds the step thread may take over one step before the engine is declared stalled (0 or None: never)."""

    def __init__(
        self,
        config: EngineConfig,
        engine: LLMEngine | None = None,
        stall_timeout: float | None = STALL_TIMEOUT_S,
    ) -> None:
        transport = StepThread(config, engine)
        super().__init__(config, transport, stall_timeout)
        self.engine = transport.engine


class StepThread:
    """The in-process transport (client.Transport): an op queue applied by a loop task between steps, the steps
    in one worker thread."""

    def __init__(self, config: EngineConfig, engine: LLMEngine | None) -> None:
        self._owns_engine = engine is None
        self.engine = engine if engine is not None else LLMEngine(config)
        self._ops: list[_Op] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._sink: Sink | None = None
        self._stopping = False
        self._failed: asyncio.Future[str] | None = None  # set when the tensor-parallel group fails
        self._applied = 0  # requests added (or refused) so far
        # When the step thread began its current step (None while no step runs), for the stall probe.
        self._step_since: float | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.engine.tokenizer

    @property
    def core_pid(self) -> None:
        """None: the engine runs in this process."""
        return None

    def process_inputs(self, request_id: str, prompt: Prompt, params: SamplingParams) -> EngineRequest:
        """`LLMEngine.process_inputs`: a grammar starts compiling in the engine's pool."""
        return self.engine.process_inputs(request_id, prompt, params)

    def stats(self) -> EngineStats:
        """The engine's stats right now."""
        return self.engine.stats()

    def add(self, request: EngineRequest) -> None:
        """Queue the request for the loop to add between steps."""
        self._submit(("add", request))

    def abort(self, request_id: str) -> None:
        """Queue the abort for the loop to apply between steps."""
        self._submit(("abort", request_id))

    def snapshot(self, answer: asyncio.Future[EngineSnapshot]) -> None:
        """Queue the snapshot: the loop takes it the next time it applies queued operations, so at most one
        step from now (one for every viewer that asked since the last add or abort)."""
        self._submit(("snapshot", answer))

    def check_integrity(self, answer: asyncio.Future[None]) -> None:
        """Queue the check for the loop to run between steps."""
        self._submit(("integrity", answer))

    def compile_grammar(self, spec: StructuredOutputsParams, answer: asyncio.Future[None]) -> None:
        """Compile in the engine's grammar pool; an answer given up (too slow) cancels a compile not begun."""
        future = self.engine.grammars.submit(spec)  # never raises; the compile runs in the pool
        loop = asyncio.get_running_loop()

        def settle() -> None:
            if answer.done():
                return
            try:
                wait(future, f"structured_outputs.{spec.kind}", timeout=0)  # RequestError or GrammarFailure
            except Exception as e:  # noqa: BLE001 - the asker's error
                answer.set_exception(e)
            else:
                answer.set_result(None)

        def compiled(_: Any) -> None:  # in the pool's thread (or this one, if it was compiled before)
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle)

        future.add_done_callback(compiled)
        answer.add_done_callback(lambda a: future.cancel() if a.cancelled() else None)

    def why_stalled(self, timeout: float) -> str | None:
        """Stalled while the step thread has been in one step for `timeout`."""
        since = self._step_since
        stuck = time.monotonic() - since if since is not None else 0.0
        if stuck > timeout:
            return stall_message(
                "the engine", stuck, "with work: its step thread is stuck in a step", timeout
            )
        return None

    # ---- lifecycle ------------------------------------------------------------------------------------

    def start(self, sink: Sink) -> None:
        """Start the loop task on the running event loop, watching the tensor-parallel group."""
        loop = asyncio.get_running_loop()
        self._sink = sink
        self._wake = asyncio.Event()
        failed: asyncio.Future[str] = loop.create_future()
        self._failed = failed

        def settle(why: str) -> None:
            if not failed.done():
                failed.set_result(why)

        def group_failed(why: str) -> None:  # called from the executor's monitor thread
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle, why)

        self.engine.executor.on_failure(group_failed)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinypaged-step")
        self._task = loop.create_task(self._run(), name="tinypaged-engine-loop")

    async def stop(self, stalled: bool) -> None:
        """Stop the loop (after the step in flight). The engine it made stops too, with every tensor-parallel
        rank; one passed in has its requests aborted."""
        self._stopping = True
        assert self._task is not None and self._wake is not None and self._executor is not None
        self._wake.set()
        await self._task
        self._executor.shutdown(wait=True)
        if self._owns_engine:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)
        else:
            self.engine.abort_all()

    # ---- the loop -------------------------------------------------------------------------------------

    def _submit(self, op: _Op) -> None:
        self._ops.append(op)
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None and self._executor is not None and self._failed is not None
        assert self._sink is not None
        loop = asyncio.get_running_loop()
        engine, sink = self.engine, self._sink
        try:
            while not self._stopping:
                if not self._ops and not engine.has_unfinished_requests():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                if self._ops:
                    self._apply_ops()
                if not engine.has_unfinished_requests():
                    continue
                steps = loop.run_in_executor(self._executor, self._steps, loop)
                await asyncio.wait((steps, self._failed), return_when=asyncio.FIRST_COMPLETED)
                if not steps.done():
                    # The tensor-parallel group failed while the step waits on the lost rank (its collective
                    # ends when it times out): the engine is dead now, the step's thread left to finish.
                    raise _GroupFailed(self._failed.result())
                try:
                    steps.result()  # each step's outputs were handed out as it completed (_deliver)
                except StepError as e:
                    logger.error("%s (requests %s)", e, e.request_ids, exc_info=e.__cause__)
                    sink.on_failed(e.request_ids, EngineError(str(e)))
                    sink.on_outputs(e.outputs, None, self._applied)
        except BaseException as e:
            # Scheduler state is unknown after an error outside a step's model work: fail everything.
            dead = death_message(e, "engine loop")
            if not isinstance(e, _GroupFailed):  # (else a step still runs: it aborts them when it returns)
                try:
                    engine.abort_all()
                except Exception:  # noqa: BLE001 - the streams are failed either way
                    logger.exception("aborting the requests of a dead engine loop")
            sink.on_death(dead)
            if not isinstance(e, Exception):
                raise

    def _steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """In the step thread: steps back to back while there is work and no operation is queued, each step's
        outputs handed to the event loop as it completes. The next step does not wait for the loop to stream the
        last one's outputs: with hundreds of streams, waiting left the engine idle a fifth of the time. An add,
        abort or query ends the run after the step in flight, so that the loop applies it between steps."""
        engine = self.engine
        try:
            while not self._stopping and not self._ops and engine.has_unfinished_requests():
                self._step_since = time.monotonic()
                result = engine.step()
                loop.call_soon_threadsafe(self._deliver, result)
        finally:
            self._step_since = None

    def _deliver(self, result: StepResult) -> None:
        assert self._sink is not None
        self._sink.on_outputs(result.outputs, result.stats, self._applied)

    def _apply_ops(self) -> None:
        assert self._sink is not None
        ops, self._ops = self._ops, []
        engine, sink, outputs = self.engine, self._sink, []
        snapshot: EngineSnapshot | None = None  # one for every viewer that asked since the last add or abort
        for kind, arg in ops:
            if kind in ("snapshot", "integrity"):
                if arg.done():
                    continue  # its asker is gone
                try:
                    if kind == "integrity":
                        engine.check_integrity()
                        arg.set_result(None)
                        continue
                    snapshot = snapshot or engine.snapshot()
                except Exception as e:  # it only reads: a failure is the asker's, the engine goes on
                    if kind == "snapshot":
                        logger.exception("taking a KV cache snapshot")
                    arg.set_exception(e)
                    continue
                arg.set_result(snapshot)
                continue
            snapshot = None
            if kind == "add":
                self._applied += 1
                try:
                    engine.add(arg)
                except RequestError as e:
                    sink.on_failed([arg.request_id], e)
            else:
                out = engine.abort_request(arg)
                if out is not None:
                    outputs.append(out)
        sink.on_outputs(outputs, None, self._applied)
