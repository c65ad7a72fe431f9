"""Structured outputs inside the engine: the requests waiting for their grammar to compile and their admission,
the requests that follow one, each step's token masks over a draw batch, and why a request whose matcher
erred fails. The engine keeps the requests themselves: this says which to schedule, which to end and how."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from concurrent.futures import Future
from typing import Any

import torch
from llguidance import LLMatcher

from tinypaged import limits, ops
from tinypaged.core.sequence import SequenceStatus
from tinypaged.engine.request import Draw, Request
from tinypaged.engine.sampling.draw_batch import DrawBatch
from tinypaged.engine.sampling.sampler import upload
from tinypaged.engine.sampling.structured import GrammarCompiler, bitmask_width, first_line, wait
from tinypaged.errors import RequestError

logger = logging.getLogger(__name__)


class GrammarState:
    """The engine's grammar side: `admit` a request with its grammar, `compiled()` each step while some
    compile, `mask` a step's draws, `failure` for the reason a request's grammar ended it."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        # Requests waiting for their grammar to compile (in the grammar pool), with their compile deadline: the
        # scheduler sees them once it is ready, and the other requests run meanwhile.
        self.compiling: dict[str, tuple[Request, Future[LLMatcher], float]] = {}
        # Ids of the requests that follow a grammar, so that a step without any skips the masking entirely;
        # pruned each masked step of those that ended.
        self.constrained: set[str] = set()

    # ---- admission ----------------------------------------------------------------------------------------

    @staticmethod
    def check(grammar: Future[LLMatcher]) -> None:
        """Raise the RequestError of a grammar already known to be bad (its spec at fault)."""
        if grammar.done() and not grammar.cancelled():
            error = grammar.exception()
            if isinstance(error, RequestError):
                raise error

    def admit(self, req: Request, grammar: Future[LLMatcher]) -> bool:
        """Start a request on its grammar: True if its matcher is built (schedule it now); else it waits here
        for the compile (`compiled`)."""
        if grammar.done() and not grammar.cancelled() and grammar.exception() is None:
            self._start(req, grammar.result())
            return True
        deadline = time.monotonic() + limits.GRAMMAR_COMPILE_TIMEOUT_S
        self.compiling[req.request_id] = (req, grammar, deadline)
        return False

    def _start(self, req: Request, matcher: LLMatcher) -> None:
        """The request's first sequence at the grammar's start."""
        req.constrained = True
        req.states[req.group.seqs[0].seq_id].matcher = matcher
        self.constrained.add(req.request_id)

    def compiled(self, idle: bool) -> tuple[list[Request], list[Request]]:
        """The waiting requests whose grammar is now compiled (to schedule), and those whose grammar failed or
        ran past the compile time limit (ended: their error set, their sequence aborted), in arrival order.
        `idle` (nothing else to run): wait a little for a compile rather than spin through empty steps."""
        if idle:
            pending = [f for _, f, _ in self.compiling.values()]
            futures.wait(pending, timeout=0.05, return_when=futures.FIRST_COMPLETED)
        now = time.monotonic()
        started: list[Request] = []
        failed: list[Request] = []
        for request_id, (req, grammar, deadline) in list(self.compiling.items()):
            if not grammar.done() and now < deadline:
                continue
            del self.compiling[request_id]
            spec = req.params.structured_outputs
            try:
                result = wait(grammar, f"structured_outputs.{spec.kind if spec else ''}", timeout=0)
            except Exception as e:  # the spec at fault (RequestError), or its compile failed otherwise
                req.error, req.error_kind = str(e), "invalid" if isinstance(e, RequestError) else "internal"
                req.group.seqs[0].status = SequenceStatus.FINISHED_ABORTED
                failed.append(req)
                continue
            self._start(req, result)
            started.append(req)
        return started, failed

    def abort(self, request_id: str) -> None:
        """Stop waiting for a request's grammar (it was never scheduled: its sequence is aborted here)."""
        entry = self.compiling.pop(request_id, None)
        if entry is not None:
            entry[0].group.seqs[0].status = SequenceStatus.FINISHED_ABORTED

    def num_waiting(self) -> tuple[int, int]:
        """Requests waiting for their grammar, and the sequences they will run."""
        waiting = list(self.compiling.values())  # a copy: stats() may be called from another thread
        return len(waiting), sum(req.params.num_seqs for req, _, _ in waiting)

    # ---- token masks --------------------------------------------------------------------------------------

    def mask(
        self,
        batch: DrawBatch,
        logits: torch.Tensor,
        live: Mapping[str, Request],
        fail: Callable[[Request, str], None],
    ) -> tuple[int, float]:
        """Set the logits of every token its grammar forbids to -inf, in place, on the rows of the batch's draws
        that follow one. Returns how many draws do, and the host time spent filling the masks. The masks are
        filled on the host (in llguidance's threads) while the device runs the forward pass, then uploaded
        and applied by one op.

        A row's draws share a matcher state (a fork's first draw is its parent's), so each row is filled
        once. A matcher in an error state, before or after its mask (past one of llguidance's limits: its mask
        then allows only EOS), fails its request alone (`fail` with the error)."""
        self.constrained.intersection_update(live)
        rows: dict[int, Any] = {}  # logits row -> its matcher
        owners: dict[int, Request] = {}
        count = 0
        for (req, draw), row in zip(*batch.all(), strict=True):
            matcher = _matcher(req, draw, live, fail)
            if matcher is None:
                continue
            rows[row], owners[row] = matcher, req
            count += 1
        spec = self._spec_draws(batch, live, fail, owners)
        if not rows and not spec:
            return count, 0.0
        cuda = logits.device.type == "cuda"
        width = bitmask_width(logits.shape[1])
        bitmask = torch.empty((len(rows) + len(spec), width), dtype=torch.int32, pin_memory=cuda)
        t0 = time.perf_counter()
        self.compiler.fill_bitmask(list(rows.values()), bitmask[: len(rows)])
        self._fill_spec(spec, bitmask[len(rows) :])
        mask_s = time.perf_counter() - t0
        rows.update((row, matcher) for row, matcher, _ in spec)
        count += len(spec)
        for row, matcher in rows.items():
            if matcher.is_error():
                fail(owners[row], first_line(matcher))
        with torch.inference_mode():  # the logits are the runner's inference tensors, written in place
            ops.apply_token_bitmask(
                logits,
                bitmask.to(logits.device, non_blocking=True),
                upload(list(rows), torch.int32, logits.device),
            )
        return count, mask_s

    @staticmethod
    def _spec_draws(
        batch: DrawBatch, live: Mapping[str, Request], fail: Callable[[Request, str], None], owners: dict
    ) -> list[tuple[int, Any, int | None]]:
        """The rows of the verifications that follow a grammar, in order: (logits row, matcher, the proposed
        token that row's position continues with, None for a proposal's last row)."""
        out: list[tuple[int, Any, int | None]] = []
        for (req, draw, v), src in zip(batch.spec, batch.spec_src, strict=True):
            matcher = _matcher(req, draw, live, fail)
            if matcher is None:
                continue
            for j in range(len(v.proposed) + 1):
                out.append((src + j, matcher, v.proposed[j] if j < len(v.proposed) else None))
                owners[src + j] = req
        return out

    def _fill_spec(self, spec: list[tuple[int, Any, int | None]], bitmask: torch.Tensor) -> None:
        """Each verification row's mask at its position: the matcher advanced through the proposed tokens
        before it, then rolled back to where it was. A proposed token the grammar refuses has probability 0 at
        its row, so it is rejected there; the rows after it, never reached, keep its row's mask."""
        consumed: dict[int, tuple[Any, int]] = {}  # id(matcher) -> (matcher, tokens consumed)
        blocked: set[int] = set()
        for i, (_, matcher, token) in enumerate(spec):
            key = id(matcher)
            if key in blocked:
                bitmask[i] = bitmask[i - 1]
            else:
                self.compiler.fill_bitmask([matcher], bitmask[i : i + 1])
            if token is None:
                blocked.discard(key)
            elif (
                key not in blocked and matcher.validate_tokens([token]) == 1 and matcher.consume_token(token)
            ):
                consumed[key] = (matcher, consumed.get(key, (matcher, 0))[1] + 1)
            else:
                blocked.add(key)
        for matcher, n in consumed.values():
            matcher.rollback(n)

    @staticmethod
    def failure(req: Request, error: str, step: int) -> str:
        """The message of a request whose matcher entered llguidance's error state (a limit of its grammar run
        out, most often its lexer's states): it fails with the reason, never "stop" with a partial output. The
        lexer was this request's own: the next request with its spec starts on a fresh one."""
        spec = req.params.structured_outputs
        what = f"structured_outputs.{spec.kind}" if spec is not None else "structured_outputs"
        logger.warning("request %s: its %s failed in engine step %d: %s", req.request_id, what, step, error)
        return f"the output could not follow its {what}: {error}"


def _matcher(
    req: Request, draw: Draw, live: Mapping[str, Request], fail: Callable[[Request, str], None]
) -> Any:
    """The matcher a draw's row is masked by; None for a request without a grammar, or one ended (not `live`),
    or whose matcher erred (then `fail`ed with the error)."""
    if not req.constrained or live.get(req.request_id) is not req:
        return None
    matcher = req.states[draw.seq.seq_id].matcher
    if matcher is None or matcher.is_error():
        fail(req, first_line(matcher) if matcher is not None else "no matcher")
        return None
    return matcher
