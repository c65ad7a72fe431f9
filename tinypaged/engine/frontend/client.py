"""The engine as its clients see it (the HTTP server, tests): a typed protocol with no torch behind it.

`AsyncEngine` implements it; the server is written against this protocol only, so it never touches tensors
and could as well talk to an engine in another process.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Protocol

from tinypaged.config import EngineConfig
from tinypaged.engine.request import Prompt
from tinypaged.engine.step.stats import EngineSnapshot, EngineStats, StepStats
from tinypaged.errors import EngineDeadError, EngineError
from tinypaged.outputs import RequestOutput
from tinypaged.sampling_params import SamplingParams
from tinypaged.tokenizer import Tokenizer


class EngineClient(Protocol):
    """Submit requests and stream their outputs; start, stop and observe the engine."""

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration (model shape, limits)."""
        ...

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        ...

    @property
    def core_pid(self) -> int | None:
        """The engine core's process id when it runs in a process of its own (None: in this one)."""
        ...

    @property
    def is_running(self) -> bool:
        """True while the engine serves (started, not shut down, not failed)."""
        ...

    @property
    def unavailable(self) -> str | None:
        """Why the engine cannot serve now: not started, shut down, dead, or stalled (no step for the stall
        timeout while it has work, or a core process silent that long); None while it serves."""
        ...

    async def start(self) -> None:
        """Start serving (idempotent)."""
        ...

    async def shutdown(self) -> None:
        """Stop; unfinished requests end with EngineError."""
        ...

    def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str, client_request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue the request now; stream its cumulative outputs, the last one finished. `client_request_id`:
        the client request it is one prompt of (the scheduler's admission takes turns between client requests);
        None, a client request of its own.

        A request the engine will not run raises RequestError (naming the parameter) here, and nothing is
        queued; a failure inside the engine raises EngineError from the stream. Closing the stream, or
        dropping it, aborts the request.
        """
        ...

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar (structured outputs), off the event loop and cached; RequestError
        naming the parameter if it is invalid, unsupported or too slow to compile. Awaited before `generate`,
        a bad grammar is refused before anything is queued."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort"."""
        ...

    def stats(self) -> EngineStats:
        """Queue lengths, cache usage and counters right now."""
        ...

    async def snapshot(self) -> EngineSnapshot:
        """The KV cache's blocks (ref counts, prefix-cache blocks, holders' request ids) and the stats, taken
        between two steps; EngineError if the engine has stopped."""
        ...

    def add_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        """Call `listener` with each step's statistics, on the event loop, as the step completes."""
        ...


def check_serving(dead: str | None, stopped: bool, stalled: str | None) -> None:
    """A client's one verdict on whether its engine takes work: EngineDeadError if it died (`dead`, why) or is
    stalled (`stalled`, why; it may move again), EngineError if it was shut down."""
    if dead is not None:
        raise EngineDeadError(dead)
    if stopped:
        raise EngineError("the engine has been shut down")
    if stalled is not None:
        raise EngineDeadError(stalled)
