"""AsyncEngine: the LLMEngine driven by one asyncio task, each request streamed through its own slot.

The event loop owns all engine mutation between steps: `generate()` and `abort()` only queue an operation
and wake the loop task, which applies the queued adds/aborts (and takes the snapshots `snapshot()` asked for),
then runs `LLMEngine.step()` in a single worker thread (so the event loop keeps accepting and streaming while
the model computes), back to back until an operation is queued, handing each step's RequestOutputs to their
requests' stream slots as the step completes. A step never races with an add, an abort or a snapshot.
A step thread that makes no step for the stall timeout is stalled (liveness.py): its requests fail and are
aborted, new ones are refused, until it steps again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from tinypaged import limits
from tinypaged.config import STALL_TIMEOUT_S, EngineConfig
from tinypaged.engine.frontend.client import check_serving
from tinypaged.engine.frontend.liveness import Watchdog, stall_message
from tinypaged.engine.frontend.streams import Streams
from tinypaged.engine.request import EngineRequest, Prompt
from tinypaged.engine.sampling.structured import wait
from tinypaged.engine.step.llm_engine import LLMEngine
from tinypaged.engine.step.queued_step import StepError
from tinypaged.engine.step.stats import EngineSnapshot, EngineStats, StepResult, StepStats
from tinypaged.errors import EngineDeadError, EngineError, RequestError
from tinypaged.outputs import RequestOutput
from tinypaged.sampling_params import SamplingParams
from tinypaged.tokenizer import Tokenizer

__all__ = ["AsyncEngine"]

logger = logging.getLogger(__name__)

# ("add", EngineRequest), ("abort", request_id) or ("snapshot", the future to set), applied in order between steps.
_Op = tuple[str, EngineRequest | str | asyncio.Future[EngineSnapshot]]


class _GroupFailed(EngineDeadError):
    """The tensor-parallel group failed while a step was still waiting on it."""


class AsyncEngine:
    """Async front of the engine (the `EngineClient` protocol): `await start()`, `async for out in
    generate(...)`, `await shutdown()`. `stall_timeout`: seconds the step thread may take over one step before
    the engine is declared stalled (0 or None: never)."""

    def __init__(
        self,
        config: EngineConfig,
        engine: LLMEngine | None = None,
        stall_timeout: float | None = STALL_TIMEOUT_S,
    ) -> None:
        self._config = config
        # An existing LLMEngine may be passed in (tests share one model load); it must be idle, and it is its
        # owner's to shut down.
        self._owns_engine = engine is None
        self.engine = engine if engine is not None else LLMEngine(config)
        self._streams = Streams(lambda request_id: self._submit(("abort", request_id)))
        self._ops: list[_Op] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stopped = False
        self._dead: str | None = None  # why the loop died, if it did
        self._failed: asyncio.Future[str] | None = None  # set when the tensor-parallel group fails
        self._step_listeners: list[Callable[[StepStats], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # Requests submitted but not yet added (their add op is queued), and their sequences: they wait too.
        self._pending_requests = 0
        self._pending_seqs = 0
        # When the step thread began its current step (None while no step runs), for the watchdog.
        self._step_since: float | None = None
        self._watchdog = Watchdog(stall_timeout, self._why_stalled, self._on_stall)

    # ---- passthroughs ---------------------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration."""
        return self._config

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        """Queue lengths, cache usage, preemptions and token counters (a snapshot); requests submitted but not
        yet handed to the engine count as waiting."""
        stats = self.engine.stats()
        return replace(
            stats,
            num_waiting=stats.num_waiting + self._pending_requests,
            num_waiting_seqs=stats.num_waiting_seqs + self._pending_seqs,
        )

    def check_integrity(self) -> None:
        """The KV cache manager's invariants (AssertionError if broken); call it while no step runs."""
        self.engine.check_integrity()

    async def snapshot(self) -> EngineSnapshot:
        """The KV cache's blocks and the stats, taken by the loop task between two steps: the next time it applies
        queued operations, so at most one step from now. EngineError if the loop stops first."""
        self._check_serving()
        await self.start()
        assert self._task is not None
        taken: asyncio.Future[EngineSnapshot] = asyncio.get_running_loop().create_future()
        self._submit(("snapshot", taken))
        try:
            await asyncio.wait((taken, self._task), return_when=asyncio.FIRST_COMPLETED)
        finally:
            taken.cancel()  # a viewer gone, or a loop stopped: nothing to take (a no-op once taken)
        if taken.cancelled():
            raise EngineError("the engine loop stopped before the snapshot was taken")
        return taken.result()

    def add_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        """Call `listener` with each step's statistics, on the event loop, as the step completes."""
        self._step_listeners.append(listener)

    @property
    def core_pid(self) -> None:
        """None: the engine runs in this process."""
        return None

    @property
    def is_running(self) -> bool:
        """True between start() and shutdown() while the loop task is alive."""
        return self._task is not None and not self._task.done()

    @property
    def unavailable(self) -> str | None:
        """Why the engine cannot serve now (not started, shut down, dead, stalled); None while it serves."""
        if self._dead is not None:
            return self._dead
        if self._stopped:
            return "the engine has been shut down"
        if not self.is_running:
            return "the engine has not started"
        return self._watchdog.stalled

    # ---- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine-loop task on the running event loop (idempotent)."""
        self._start()

    def _start(self) -> None:
        if self._stopped:
            raise EngineError("the engine has been shut down")
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        failed: asyncio.Future[str] = self._loop.create_future()
        self._failed = failed
        loop = self._loop

        def settle(why: str) -> None:
            if not failed.done():
                failed.set_result(why)

        def group_failed(why: str) -> None:  # called from the executor's monitor thread
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle, why)

        self.engine.executor.on_failure(group_failed)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinypaged-step")
        self._task = self._loop.create_task(self._run(), name="tinypaged-engine-loop")
        self._watchdog.start()

    async def shutdown(self) -> None:
        """Stop the loop (after the step in flight); unfinished requests fail with EngineError. The engine it
        made stops too, with every tensor-parallel rank."""
        self._stopped = True
        self._watchdog.stop()
        if self._task is not None:
            assert self._wake is not None
            self._wake.set()
            await self._task
        self._streams.fail(self._streams.ids(), EngineError("the engine was shut down"))
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._owns_engine:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)
        else:
            self.engine.abort_all()

    # ---- requests -------------------------------------------------------------------------------------

    def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str, client_request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue the request now and stream its cumulative RequestOutput after each step it advanced in (the
        newest only, when several are waiting for a slow consumer); the last is finished.

        Checked and queued when called (RequestError naming the parameter if the engine will not run it;
        nothing is queued then), so a caller's admission check and the queueing happen without an await
        between them. Closing or cancelling the iterator, or dropping it unread (a client gone), aborts the
        request and frees its blocks before the next step. A failure inside the engine raises EngineError.
        """
        self._check_serving()
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use")
        request = replace(
            self.engine.process_inputs(request_id, prompt, params), client_request_id=client_request_id
        )
        self._start()
        stream = self._streams.open(request_id)
        self._pending_requests += 1
        self._pending_seqs += params.num_seqs
        self._submit(("add", request))
        return stream

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar (structured outputs) in the engine's grammar pool, off the event loop,
        once per distinct grammar; RequestError naming the parameter if it is invalid, unsupported or too slow
        to compile. A request whose grammar is compiled is queued ready to run."""
        spec = params.structured_outputs
        if spec is None:
            return
        future = self.engine.grammars.submit(spec)  # never raises; the compile runs in the pool
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), limits.GRAMMAR_COMPILE_TIMEOUT_S)
        except TimeoutError as e:
            raise RequestError(
                f"the {spec.kind} did not compile within {limits.GRAMMAR_COMPILE_TIMEOUT_S} s",
                f"structured_outputs.{spec.kind}",
            ) from e
        except BaseException:
            if not future.done():
                raise  # this coroutine was cancelled
        wait(future, f"structured_outputs.{spec.kind}", timeout=0)  # RequestError or GrammarFailure

    async def abort(self, request_id: str) -> None:
        """Abort a request; its iterator ends with a finished output (finish_reason "abort")."""
        if request_id in self._streams:
            self._submit(("abort", request_id))

    def _check_serving(self) -> None:
        """EngineDeadError if the loop died or the engine is stalled, EngineError if it was shut down."""
        check_serving(self._dead, self._stopped, self._watchdog.stalled)

    # ---- liveness (the watchdog's probe and verdict) ----------------------------------------------------

    def _why_stalled(self, timeout: float) -> str | None:
        since = self._step_since
        stuck = time.monotonic() - since if since is not None else 0.0
        if stuck > timeout:
            return stall_message(
                "the engine", stuck, "with work: its step thread is stuck in a step", timeout
            )
        return None

    def _on_stall(self, why: str) -> None:
        """The step is stuck: its requests fail now, and are aborted once (if ever) it returns."""
        ids = self._streams.ids()
        self._streams.fail(ids, EngineDeadError(why))
        for rid in ids:
            self._submit(("abort", rid))

    # ---- the loop -------------------------------------------------------------------------------------

    def _submit(self, op: _Op) -> None:
        self._ops.append(op)
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None and self._executor is not None and self._failed is not None
        loop = asyncio.get_running_loop()
        engine = self.engine
        try:
            while not self._stopped:
                if not self._ops and not engine.has_unfinished_requests():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
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
                    self._streams.fail(e.request_ids, EngineError(str(e)))
                    self._streams.dispatch(e.outputs)
        except BaseException as e:
            # Scheduler state is unknown after an error outside a step's model work: fail everything. A failed
            # tensor-parallel group says what failed (a worker's rank and exit); anything else is logged only.
            if isinstance(e, EngineDeadError):
                self._dead = f"the engine has stopped: {e}"
                logger.error("engine loop stopped: %s", e)
            else:
                self._dead = "the engine loop stopped (an internal error, logged)"
                logger.exception("engine loop died")
            if not isinstance(e, _GroupFailed):  # (else a step still runs: it aborts them when it returns)
                try:
                    engine.abort_all()
                except Exception:  # noqa: BLE001 - the streams are failed below either way
                    logger.exception("aborting the requests of a dead engine loop")
            self._streams.fail(self._streams.ids(), EngineDeadError(self._dead))
            if not isinstance(e, Exception):
                raise

    def _steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """In the step thread: steps back to back while there is work and no operation is queued, each step's
        outputs handed to the event loop as it completes. The next step does not wait for the loop to stream the
        last one's outputs: with hundreds of streams, waiting left the engine idle a fifth of the time. An add,
        abort or snapshot ends the run after the step in flight, so that the loop applies it between steps."""
        engine = self.engine
        try:
            while not self._stopped and not self._ops and engine.has_unfinished_requests():
                self._step_since = time.monotonic()
                result = engine.step()
                loop.call_soon_threadsafe(self._deliver, result)
        finally:
            self._step_since = None

    def _deliver(self, result: StepResult) -> None:
        self._streams.dispatch(result.outputs)
        for listener in self._step_listeners:
            listener(result.stats)

    def _apply_ops(self) -> None:
        ops, self._ops = self._ops, []
        snapshot: EngineSnapshot | None = None  # one for every viewer that asked since the last add or abort
        for kind, arg in ops:
            if isinstance(arg, asyncio.Future):
                if arg.done():
                    continue  # cancelled: its viewer is gone
                try:
                    snapshot = snapshot or self.engine.snapshot()
                except Exception as e:  # it only reads: a failure is the viewer's, the engine goes on
                    logger.exception("taking a KV cache snapshot")
                    arg.set_exception(e)
                    continue
                arg.set_result(snapshot)
                continue
            snapshot = None
            if isinstance(arg, EngineRequest):
                self._pending_requests -= 1
                self._pending_seqs -= arg.params.num_seqs
                try:
                    self.engine.add(arg)
                except RequestError as e:
                    self._streams.fail([arg.request_id], e)
            else:
                assert kind == "abort"
                out = self.engine.abort_request(arg)
                if out is not None:
                    self._streams.dispatch([out])
