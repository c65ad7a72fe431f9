"""Liveness of an engine whose steps run out of the event loop's sight (a core process, a step thread): a
watchdog that declares it stalled when it makes no step for the stall timeout, and well again when it moves.

A stall is not a death: the engine may only be slow, or stopped (SIGSTOP) and resumed. So the requests waiting
on it fail at once (they must not hang until their clients give up) and are aborted, new ones are refused and
`/health` answers 503 naming the stall, but the engine is kept: once it steps again, it serves again, with its
model loaded and its blocks freed by the aborts. One that never moves again stays unhealthy for a supervisor
to restart it; a core process that exits is dead at once, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from tinypaged.errors import EngineDeadError

logger = logging.getLogger(__name__)

# A core process's heartbeat comes from a thread of its own, which runs whatever a step does (torch lets go of
# the interpreter lock in its kernels; a Triton compile holds it for seconds): a core silent for this long (or
# the stall timeout, if shorter) is stopped or frozen, and is noticed far sooner than a stuck step.
SILENCE_TIMEOUT_S = 30.0


def heartbeat_interval(stall_timeout: float | None) -> float:
    """Seconds between two liveness checks (and two heartbeats of a core): a few within one stall timeout."""
    return 0.5 if not stall_timeout else min(0.5, stall_timeout / 4)


class Watchdog:
    """An asyncio task that asks `probe(timeout)` every heartbeat interval why the engine is stalled (None: it
    is not), calls `on_stall(why)` when it becomes so, and clears `stalled` when it moves again. A timeout of 0
    or None watches nothing."""

    def __init__(
        self, timeout: float | None, probe: Callable[[float], str | None], on_stall: Callable[[str], None]
    ) -> None:
        self.timeout = timeout or None
        self.stalled: str | None = None  # why, while stalled
        self._probe, self._on_stall = probe, on_stall
        self._task: asyncio.Task[None] | None = None
        self._since = 0.0

    def start(self) -> None:
        """Start watching on the running event loop (idempotent)."""
        if self.timeout is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="tinypaged-watchdog")

    def stop(self) -> None:
        """Stop watching."""
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        assert self.timeout is not None
        every = heartbeat_interval(self.timeout)
        while True:
            await asyncio.sleep(every)
            why = self._probe(self.timeout)
            if why is not None and self.stalled is None:
                self.stalled, self._since = why, time.monotonic()
                logger.error("%s: its requests fail, new ones are refused until it moves again", why)
                self._on_stall(why)
            elif why is not None:
                self.stalled = why  # (for how long, as of now)
            elif self.stalled is not None:
                stalled_s = time.monotonic() - self._since
                logger.warning("the engine moves again, %.1f s after it was declared stalled", stalled_s)
                self.stalled = None


def stall_message(engine: str, stuck_s: float, cause: str, limit: float) -> str:
    """What a stalled engine's requests and `/health` say."""
    return f"{engine} is stalled: it made no step for {stuck_s:.1f} s {cause} (limit {limit:g} s)"


def death_message(e: BaseException, loop: str) -> str:
    """Why an engine's `loop` ("engine loop", "engine core") stopped on `e`, as its requests and `/health` say,
    logged: a failed tensor-parallel group says what failed (a worker's rank and exit); anything else is an
    internal error, its traceback logged only."""
    if isinstance(e, EngineDeadError):
        logger.error("%s stopped: %s", loop, e)
        return f"the engine has stopped: {e}"
    logger.error("%s died", loop, exc_info=e)
    return "the engine loop stopped (an internal error, logged)"
