"""Beam search over a request's sequences, with HF transformers' semantics (`generate(num_beams=W)`).

Each step takes the top K = max(2, 1 + #stop ids) * W continuations of all live beams by cumulative logprob.
The best W that do not stop become the next beams (the plan forks and drops sequences to match, so beams
share their common blocks); those among the first W that stop (a stop/EOS token, or the length limit)
become finished hypotheses scored cumulative_logprob / generated_len ** length_penalty, and the W best are
kept. The search ends when W hypotheses are kept and early_stopping is True, when no live beam can beat the
worst kept hypothesis (early_stopping False: at the current length; "never": at the length limit if
length_penalty > 0), or when every continuation stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tinypaged.core.sequence import Sequence, SequenceStatus
from tinypaged.engine.request import Draw, Extend, Fork, Plan, Request, TokenSample
from tinypaged.outputs import CompletionOutput, Logprob
from tinypaged.sampling_params import SamplingParams
from tinypaged.tokenizer import Tokenizer


@dataclass
class Hypothesis:
    """A finished beam."""

    score: float  # cumulative_logprob / generated_len ** length_penalty
    token_ids: list[int]  # the generated tokens, the stop token included
    cumulative_logprob: float
    logprobs: list[dict[int, Logprob]] | None
    stopped: bool  # by a stop/EOS token (else by the length limit)


@dataclass(frozen=True)
class Candidate:
    """One continuation: a live beam (by sequence id) extended by a token."""

    parent: int
    token: int
    logprob: float  # of the token
    rank: int  # of the token in its beam's distribution (0: not computed, no logprobs asked for)
    cumulative_logprob: float
    stopped: bool  # the token is a stop/EOS token


class BeamSearch:
    """The beam-search strategy of one request: pending log-probability rows and the kept hypotheses."""

    def __init__(
        self, params: SamplingParams, stop_ids: frozenset[int], max_new_tokens: int, tokenizer: Tokenizer
    ) -> None:
        self.params = params
        self.stop_ids = stop_ids
        self.max_new_tokens = max_new_tokens  # HF's max_length - prompt length
        self.tokenizer = tokenizer
        self.hyps: list[Hypothesis] = []  # best first, at most `width`
        self.pending: dict[int, torch.Tensor] = {}  # seq id -> logprob row of its next token
        self.improvable = True
        self.done = False

    @property
    def width(self) -> int:
        """The beam width: best_of (default n)."""
        return self.params.num_seqs

    def select(
        self, beams: list[tuple[int, float]], num_generated: int
    ) -> tuple[list[Candidate], list[tuple[float, Candidate]]]:
        """One step over the live beams `(seq id, cumulative logprob)`, all with `num_generated` tokens.

        Returns the next beams (best first) and the finishing candidates to keep as hypotheses, with their
        scores. Consumes the pending rows of these beams.

        HF ranks the top (1 + #stop ids) x W continuations; only the first W can finish and the best W that
        do not stop continue. Those are the best W continuations by a non-stop token and the best W by a stop
        token, merged: the work and memory stay O(W x vocab) however many stop ids a request gives.
        """
        rows = torch.stack([self.pending.pop(seq_id) for seq_id, _ in beams])
        cum = torch.tensor([c for _, c in beams], dtype=rows.dtype, device=rows.device)
        vocab, width = rows.shape[1], self.width
        scores = rows + cum[:, None]
        at_limit = num_generated + 1 >= self.max_new_tokens
        stop = sorted(t for t in self.stop_ids if t < vocab)
        if at_limit or not stop:
            # Nothing can stop by a token: every candidate either finishes (at the limit) or runs on.
            top, flat = scores.flatten().topk(min(width, scores.numel()))
            parents, tokens = flat // vocab, flat % vocab
        else:
            stop_ids = torch.tensor(stop, device=rows.device)
            top_run, flat_run = (
                scores.index_fill(1, stop_ids, float("-inf")).flatten().topk(min(width, scores.numel()))
            )
            by_stop = scores.index_select(1, stop_ids)
            top_stop, flat_stop = by_stop.flatten().topk(min(width, by_stop.numel()))
            order = torch.cat([top_run, top_stop]).argsort(descending=True, stable=True)
            top = torch.cat([top_run, top_stop])[order]
            parents = torch.cat([flat_run // vocab, flat_stop // len(stop)])[order]
            tokens = torch.cat([flat_run % vocab, stop_ids[flat_stop % len(stop)]])[order]
        lps = rows[parents, tokens]
        # Ranks only for the logprobs a client asked for: counting over the vocabulary is the costly part.
        ranks = (
            ((rows[parents] > lps[:, None]).sum(dim=-1) + 1).tolist()
            if self.params.logprobs is not None
            else [0] * len(tokens)
        )
        cands = []
        for value, parent, token, lp, rank in zip(
            top.tolist(), parents.tolist(), tokens.tolist(), lps.tolist(), ranks, strict=True
        ):
            stopped = token in self.stop_ids
            if value == float("-inf"):
                # A stop token masked out of the running candidates (a vocabulary smaller than W), or a token
                # that is banned or that the beam's grammar forbids: never a continuation.
                continue
            cands.append(Candidate(beams[parent][0], token, lp, rank, value, stopped))
        running = [c for c in cands if not (c.stopped or at_limit)][:width]
        # Only the first `width` candidates may become hypotheses; the rest only back up the live beams.
        finishing = [c for c in cands[:width] if c.stopped or at_limit]
        full = len(self.hyps) >= width
        if not self.improvable or (full and self.params.early_stopping is True):
            finishing = []
        scale = (num_generated + 1) ** self.params.length_penalty
        return running, [(c.cumulative_logprob / scale, c) for c in finishing]

    def keep(self, hyps: list[Hypothesis], running: list[Candidate], num_generated: int) -> None:
        """Merge new hypotheses, keep the best `width`; decide whether the search is done.

        `num_generated` counts the tokens of the new beams (after this step).
        """
        p = self.params
        self.hyps = sorted(self.hyps + hyps, key=lambda h: h.score, reverse=True)[: self.width]
        full = len(self.hyps) >= self.width
        if full and running:
            length = (
                self.max_new_tokens if p.early_stopping == "never" and p.length_penalty > 0 else num_generated
            )
            best_possible = running[0].cumulative_logprob / (length**p.length_penalty)
            self.improvable = self.improvable and best_possible > self.hyps[-1].score
        self.done = not self.improvable or (full and p.early_stopping is True) or not running

    # ---- the strategy interface (request.py) ------------------------------------------------------------

    def draws(self, req: Request, seq: Sequence) -> list[Draw]:
        """The whole log-probability row of each beam; never deferred (the next beams are chosen on the host)."""
        return [Draw(seq, req.states[seq.seq_id].seed_key, scores=True)]

    def plan(self, req: Request, results: list[tuple[Draw, Any]]) -> Plan:
        """Once every live beam has its row: the next beams (forked and extended), the beams left behind
        (dropped), and when the search is done, the live beams finished."""
        for draw, row in results:
            self.pending[draw.seq.seq_id] = row
        live = req.group.unfinished_seqs()
        if any(s.seq_id not in self.pending for s in live):
            return Plan([])  # some beams were not computed in this step (budget): wait for them
        states = req.states
        by_id = {s.seq_id: s for s in live}
        num_generated = live[0].num_tokens - live[0].prompt_len
        running, finishing = self.select(
            [(s.seq_id, states[s.seq_id].cumulative_logprob) for s in live], num_generated
        )

        def logprobs_after(parent: int, c: Candidate) -> list[dict[int, Logprob]] | None:
            before = states[parent].logprobs
            if before is None:
                return None
            return [*before, {c.token: Logprob(c.logprob, c.rank, self.tokenizer.decode([c.token], False))}]

        hyps = [
            Hypothesis(
                score,
                by_id[c.parent].token_ids[by_id[c.parent].prompt_len :] + [c.token],
                c.cumulative_logprob,
                logprobs_after(c.parent, c),
                c.stopped,
            )
            for score, c in finishing
        ]
        self.keep(hyps, running, num_generated + 1)
        if self.done:
            running = []
        # The first candidate of a parent continues in the parent's sequence; the others fork it (sharing all
        # its blocks). Parents no candidate chose are left behind: dropped, their blocks freed.
        extend: list[Extend] = []
        forks: list[Fork] = []
        used: set[int] = set()
        for i, c in enumerate(running):
            parent = by_id[c.parent]
            target: Sequence | Fork = parent
            if c.parent in used:
                target = Fork(parent, i)
                forks.append(target)
            used.add(c.parent)
            extend.append(Extend(target, TokenSample(c.token, c.logprob, c.rank), c.cumulative_logprob))
        # Done: the outputs are the hypotheses. Else the beams no candidate chose are left behind for good: the
        # outputs come from the live beams and the hypotheses.
        unused = [s for s in live if s.seq_id not in used]
        return Plan(extend, forks, finish=unused) if self.done else Plan(extend, forks, drop=unused)

    def outputs(self, req: Request) -> list[CompletionOutput]:
        """The n best hypotheses once the search is done; the n best live beams while it runs."""
        p = self.params

        def text(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, p.skip_special_tokens)

        if self.done and self.hyps:
            return [
                CompletionOutput(
                    index=i,
                    text=text(h.token_ids),
                    token_ids=list(h.token_ids),
                    cumulative_logprob=h.cumulative_logprob,
                    logprobs=h.logprobs,
                    finish_reason="stop" if h.stopped else "length",
                    stop_reason=h.token_ids[-1]
                    if h.stopped and h.token_ids[-1] in p.stop_token_ids
                    else None,
                )
                for i, h in enumerate(self.hyps[: p.n])
            ]
        # The live beams, best first (a stable sort: ties keep the group's order).
        beams = sorted(req.group.seqs, key=lambda s: req.states[s.seq_id].cumulative_logprob, reverse=True)
        outputs = []
        for i, seq in enumerate(beams[: p.n]):
            state = req.states[seq.seq_id]
            ids = seq.token_ids[seq.prompt_len :]
            reason = "abort" if seq.status == SequenceStatus.FINISHED_ABORTED else None
            outputs.append(
                CompletionOutput(i, text(ids), ids, state.cumulative_logprob, state.logprobs, reason)
            )
        return outputs
