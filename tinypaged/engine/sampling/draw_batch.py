"""A step's draws as one batch: what each request's strategy asked of which logits row, split into the token
draws (one sampler pass) and the score draws (one log-probability pass, beam search); the sampler, the grammars'
masks and the search for the requests at fault all take it whole."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tinypaged.core.schedule_types import ScheduledSeq
from tinypaged.core.sequence import Sequence, SequenceStatus
from tinypaged.engine.request import Draw, Request
from tinypaged.engine.sampling.rejection import Verified, Verify, verify
from tinypaged.engine.sampling.sampler import SampledBatch, Sampler, SamplingRow, has_penalty, upload

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class DrawRows:
    """Draws of one kind: draw i reads logits row `src[i]` with `rows[i]`'s sampling parameters."""

    draws: list[tuple[Request, Draw]] = field(default_factory=list)
    rows: list[SamplingRow] = field(default_factory=list)
    src: list[int] = field(default_factory=list)  # the logits row of each draw

    def keep(self, mine: list[int]) -> DrawRows:
        """Only the draws at these positions, in order."""
        return DrawRows(
            [self.draws[i] for i in mine], [self.rows[i] for i in mine], [self.src[i] for i in mine]
        )

    def run(
        self,
        run: Callable[[torch.Tensor, list[SamplingRow]], Any],
        logits: torch.Tensor,
        fail: Callable[[Request], None],
        index: int,
    ) -> tuple[Any, DrawRows]:
        """`run` over every row at once; if it raises, find the requests at fault by running each request's
        rows alone, `fail` them, and run the rest together. Returns the result and the draws it covers."""
        try:
            return run(_rows_of(logits, self.src), self.rows), self
        except Exception:
            logger.exception("engine step %d: the sampler failed; looking for the requests at fault", index)
        keep: list[int] = []
        for req in dict.fromkeys(req for req, _ in self.draws):
            mine = [i for i, (r, _) in enumerate(self.draws) if r is req]
            part = self.keep(mine)
            try:
                run(_rows_of(logits, part.src), part.rows)
            except Exception:
                fail(req)
                continue
            keep += mine
        if not keep:
            return None, DrawRows()
        rest = self.keep(keep)
        return run(_rows_of(logits, rest.src), rest.rows), rest


@dataclass(eq=False)
class DrawBatch:
    """Every draw of one step: `token` draws are sampled, `score` draws (beam search) return whole rows, `spec`
    draws verify proposed tokens (speculative decoding) from k + 1 rows starting at their `spec_src`."""

    token: DrawRows = field(default_factory=DrawRows)
    score: DrawRows = field(default_factory=DrawRows)
    spec: list[tuple[Request, Draw, Verify]] = field(default_factory=list)
    spec_src: list[int] = field(default_factory=list)

    @classmethod
    def collect(
        cls,
        scheduled: Iterable[ScheduledSeq],
        requests: Mapping[str, Request],
        get_seq: Callable[[int], Sequence | None],
        eos_ids: frozenset[int],
        fail: Callable[[Request], None],
        draft_of: Callable[[int], Any] = lambda seq_id: (None, None),
    ) -> DrawBatch:
        """The draws each running request's strategy asks of its sequences' logits rows this step (the rows of
        the scheduled sequences that sample, in order: one each, k + 1 for a verification of k proposed tokens,
        whose draft distributions, and the oracle's accepted count, `draft_of` gives). A request whose draws
        cannot be prepared is `fail`ed (called while its exception is handled)."""
        batch = cls()
        token, score = batch.token, batch.score
        row = 0
        for s in scheduled:
            if not s.do_sample:
                continue
            row += 1 + s.num_spec_tokens
            req = requests.get(s.request_id)
            seq = get_seq(s.seq_id)
            if req is None or seq is None or seq.status != SequenceStatus.RUNNING:
                continue
            try:
                if s.num_spec_tokens:
                    proposed = s.token_ids[len(s.token_ids) - s.num_spec_tokens :]
                    (draw,) = req.strategy.draws(req, seq)
                    draw = draw._replace(spec=proposed, defer=False)
                    rows = [spec_row(req, seq, draw, eos_ids, proposed[:j]) for j in range(len(proposed) + 1)]
                    batch.spec.append((req, draw, Verify(rows, proposed, *draft_of(seq.seq_id))))
                    batch.spec_src.append(row - 1 - s.num_spec_tokens)
                    continue
                draws = [(d, sampling_row(req, seq, d, eos_ids)) for d in req.strategy.draws(req, seq)]
            except Exception:
                fail(req)
                continue
            for draw, sampling in draws:
                part = score if draw.scores else token
                part.draws.append((req, draw))
                part.rows.append(sampling)
                part.src.append(row - 1)
        return batch

    def all(self) -> tuple[list[tuple[Request, Draw]], list[int]]:
        """Every draw, token draws first, with its logits row."""
        return self.token.draws + self.score.draws, self.token.src + self.score.src

    def drop_ended(self, live: Mapping[str, Request]) -> None:
        """Forget the draws of requests that ended (no longer `live` under their id)."""
        alive = [i for i, (req, _, _) in enumerate(self.spec) if live.get(req.request_id) is req]
        self.spec = [self.spec[i] for i in alive]
        self.spec_src = [self.spec_src[i] for i in alive]
        for name in ("token", "score"):
            part: DrawRows = getattr(self, name)
            alive = [i for i, (req, _) in enumerate(part.draws) if live.get(req.request_id) is req]
            if len(alive) < len(part.draws):
                setattr(self, name, part.keep(alive))

    def sample(
        self, sampler: Sampler, logits: torch.Tensor, fail: Callable[[Request], None], index: int
    ) -> tuple[SampledBatch | None, torch.Tensor | None]:
        """Queue the sampler's pass over the token draws and the scoring pass over the score draws; a request
        whose rows make either raise is found alone, `fail`ed, and its draws dropped."""
        sampled = scores = None
        if self.token.draws:
            best_of = any(r.params.num_seqs > r.params.n for r in self.token.rows)  # ranks samples by logprob

            def sample(rows: torch.Tensor, sampling_rows: list[SamplingRow]) -> SampledBatch:
                return sampler.sample(rows, sampling_rows, need_logprobs=best_of)

            sampled, self.token = self.token.run(sample, logits, fail, index)
        if self.score.draws:
            scores, self.score = self.score.run(sampler.beam_logprobs, logits, fail, index)
        return sampled, scores

    def verify(
        self, sampler: Sampler, logits: torch.Tensor, fail: Callable[[Request], None], index: int
    ) -> list[tuple[Request, Draw, Verified]]:
        """Verify the spec draws' proposals against their rows (rejection.py), waiting for the device; if that
        raises, each of their requests is `fail`ed."""
        if not self.spec:
            return []
        rows = [
            src + j
            for src, (_, _, v) in zip(self.spec_src, self.spec, strict=True)
            for j in range(len(v.rows))
        ]
        try:
            results = verify(sampler, _rows_of(logits, rows), [v for _, _, v in self.spec])
        except Exception:
            logger.exception("engine step %d: verifying proposed tokens failed", index)
            for req in dict.fromkeys(req for req, _, _ in self.spec):
                fail(req)
            return []
        return [(req, draw, r) for (req, draw, _), r in zip(self.spec, results, strict=True)]


def spec_row(
    req: Request, seq: Sequence, draw: Draw, eos_ids: frozenset[int], accepted: tuple[int, ...]
) -> SamplingRow:
    """The sampling row of a verification's position after the proposed tokens `accepted`: as `sampling_row`
    would make it once they were appended (penalties count them; min_tokens counts them)."""
    row = sampling_row(req, seq, draw, eos_ids)
    if not accepted:
        return row
    p = req.params
    generated = row.generated + len(accepted)
    banned = tuple(eos_ids | set(p.stop_token_ids)) if generated < p.min_tokens else ()
    output_ids = row.output_ids + list(accepted) if has_penalty(p) else []
    return SamplingRow(p, row.prompt_ids, output_ids, row.seed_key, banned, generated)


def sampling_row(req: Request, seq: Sequence, draw: Draw, eos_ids: frozenset[int]) -> SamplingRow:
    """What the sampler needs for one draw from `seq`: its penalties' token lists (only when they apply), EOS
    and the stop tokens banned below min_tokens."""
    p = req.params
    num_outputs = seq.num_tokens - seq.prompt_len  # counting tokens pending on the device
    prompt_ids = seq.token_ids[: seq.prompt_len] if p.repetition_penalty != 1.0 else []
    output_ids = seq.token_ids[seq.prompt_len :] if has_penalty(p) else []
    banned = tuple(eos_ids | set(p.stop_token_ids)) if num_outputs < p.min_tokens else ()
    return SamplingRow(p, prompt_ids, output_ids, draw.seed_key, banned, num_outputs)


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The given rows of the step's logits (the whole tensor when they are all of them, in order)."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[upload(rows, torch.int64, logits.device)]
