"""A step's DrawBatch alone (no model): the draws of ended requests dropped from both kinds at once, and a pass
that raises retried request by request so that only the request at fault is failed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tinypaged.engine.sampling.draw_batch import DrawBatch, DrawRows


@dataclass(eq=False)
class FakeRequest:
    request_id: str


@dataclass(frozen=True)
class FakeDraw:
    name: str
    scores: bool = False


def _batch(reqs: list[FakeRequest], per_request: int = 2) -> DrawBatch:
    batch = DrawBatch()
    row = 0
    for req in reqs:
        for k in range(per_request):
            part = batch.score if k % 2 else batch.token
            part.draws.append((req, FakeDraw(f"{req.request_id}.{k}", scores=bool(k % 2))))
            part.rows.append(f"{req.request_id}.{k}")
            part.src.append(row)
            row += 1
    return batch


def test_drop_ended_keeps_the_live_requests_in_order() -> None:
    reqs = [FakeRequest(f"r{i}") for i in range(4)]
    batch = _batch(reqs)
    stale = FakeRequest("r2")  # a new request under an ended one's id: the old one's draws still go
    live = {"r0": reqs[0], "r2": stale, "r3": reqs[3]}
    batch.drop_ended(live)
    for part in (batch.token, batch.score):
        assert [r.request_id for r, _ in part.draws] == ["r0", "r3"]
        assert len(part.rows) == len(part.src) == 2
    assert batch.token.src == [0, 6] and batch.score.src == [1, 7]
    draws, src = batch.all()
    assert [d.name for _, d in draws] == ["r0.0", "r3.0", "r0.1", "r3.1"] and src == [0, 6, 1, 7]


@pytest.mark.parametrize("bad", [set(), {"r1"}, {"r0", "r2"}, {"r0", "r1", "r2"}])
def test_run_isolates_the_requests_at_fault(bad: set[str]) -> None:
    reqs = [FakeRequest(f"r{i}") for i in range(3)]
    part = DrawRows()
    for row, req in enumerate(reqs * 2):  # each request draws from two rows, interleaved
        part.draws.append((req, FakeDraw(f"{req.request_id}@{row}")))
        part.rows.append(req.request_id)
        part.src.append(row)
    logits = torch.arange(6, dtype=torch.float32)[:, None] * torch.ones(1, 4)
    calls: list[list[float]] = []

    def run(rows: torch.Tensor, sampling_rows: list) -> list:
        calls.append(rows[:, 0].tolist())
        assert rows.shape[0] == len(sampling_rows)
        if bad & set(sampling_rows):
            raise RuntimeError("injected")
        return sampling_rows

    failed: list[FakeRequest] = []
    result, kept = part.run(run, logits, failed.append, index=0)
    assert [r.request_id for r in failed] == sorted(bad)
    # With a fault the rest run together grouped by request, in the order of each request's first draw.
    good = [req.request_id for req in reqs if req.request_id not in bad for _ in range(2)]
    if not bad:
        good = [req.request_id for req in reqs * 2]
    assert [r.request_id for r, _ in kept.draws] == good
    assert result == (good or None)
    if bad:  # the whole batch, then each request alone, then the rest together
        assert calls[0] == [0, 1, 2, 3, 4, 5] and calls[1:4] == [[0, 3], [1, 4], [2, 5]]
        assert calls[4:] == ([[float(s) for s in kept.src]] if good else [])
    else:
        assert calls == [[0, 1, 2, 3, 4, 5]]
