"""A step's work as queued on the device (QueuedStep), and the error of a step that failed (StepError)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tinypaged.engine.device.staging import PendingTokens
from tinypaged.engine.request import Draw, Request
from tinypaged.engine.sampling.rejection import Verified
from tinypaged.engine.sampling.sampler import SampledBatch
from tinypaged.errors import EngineError
from tinypaged.outputs import RequestOutput


class StepError(EngineError):
    """A step raised: the requests it concerned were aborted (their blocks freed); the rest go on."""

    def __init__(self, message: str, request_ids: list[str], outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.request_ids = request_ids  # the failed requests
        self.outputs = outputs  # outputs of other requests produced before the failure (e.g. ignored ones)


@dataclass(eq=False)
class QueuedStep:
    """One step's draws as queued on the device, applied once their results reach the host: at once, or
    (deferred, async scheduling) during the next step, after that step's forward pass has been queued. The
    sequences of a deferred step carry their sampled token as pending until then."""

    index: int
    token_draws: list[tuple[Request, Draw]]  # row i of `sampled`
    sampled: SampledBatch | None
    score_draws: list[tuple[Request, Draw]]  # row i of `scores`
    scores: torch.Tensor | None  # log-probability rows (beam search)
    deferred: bool
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None  # around the forward pass (runner.time_device)
    num_constrained: int = 0  # draws that follow a grammar (their logits rows masked)
    mask_s: float = 0.0  # host time filling their token masks
    # Verifications of proposed tokens (speculative decoding), done by the time the step is queued; a step
    # with any is never deferred (the next proposals need its tokens on the host).
    spec_draws: list[tuple[Request, Draw, Verified]] = field(default_factory=list)
    wait_s: float = 0.0
    device_s: float | None = None

    @property
    def constrained(self) -> bool:
        """Whether a draw follows a grammar: the next step's masks need this step's tokens first."""
        return self.num_constrained > 0

    @property
    def num_draws(self) -> int:
        """Draws queued in this step."""
        return len(self.token_draws) + len(self.score_draws) + len(self.spec_draws)

    def request_ids(self) -> list[str]:
        """The requests with draws in this step."""
        spec = [req.request_id for req, _, _ in self.spec_draws]
        return list(dict.fromkeys([req.request_id for req, _ in self.token_draws + self.score_draws] + spec))

    def pending_tokens(self) -> PendingTokens | None:
        """Where the next step finds each sequence's token on the device (deferred steps)."""
        if self.sampled is None:
            return None
        return PendingTokens(
            self.sampled.token_ids, {d.seq.seq_id: i for i, (_, d) in enumerate(self.token_draws)}
        )

    def results(self) -> tuple[dict[Request, list[tuple[Draw, Any]]], set[Request]]:
        """Every draw with its result (a TokenSample, or a log-probability row), once they reach the host, by
        request in the order of their first draw; and the requests with a draw whose distribution was unusable
        (NaN, infinities, or every token banned)."""
        t0 = time.perf_counter()
        out: list[tuple[Request, Draw, Any]] = []
        invalid: set[Request] = set()
        if self.sampled is not None:
            result = self.sampled.result()
            out += [(req, d, s) for (req, d), s in zip(self.token_draws, result.samples(), strict=True)]
            if result.valid is not None and not all(result.valid):
                invalid.update(
                    req for (req, _), ok in zip(self.token_draws, result.valid, strict=True) if not ok
                )
        out += [(req, d, v.samples) for req, d, v in self.spec_draws]
        invalid.update(req for req, _, v in self.spec_draws if not v.valid)
        if self.scores is not None:
            out += [(req, d, self.scores[i]) for i, (req, d) in enumerate(self.score_draws)]
            finite = torch.isfinite(self.scores.amax(dim=-1)).tolist()
            invalid.update(req for (req, _), ok in zip(self.score_draws, finite, strict=True) if not ok)
        if self.events is not None:
            self.events[1].synchronize()
            self.device_s = self.events[0].elapsed_time(self.events[1]) / 1e3
        self.wait_s = time.perf_counter() - t0
        by_request: dict[Request, list[tuple[Draw, Any]]] = {}
        for req, draw, value in out:
            items = by_request.get(req)
            if items is None:
                by_request[req] = [(draw, value)]
            else:
                items.append((draw, value))
        return by_request, invalid
