"""Parallel sampling: n independent samples of a prompt (best_of drawn, the n best returned); n = 1 is plain
sampling or greedy decoding. The strategy interface is in request.py."""

from __future__ import annotations

from typing import Any

from tinypaged.core.sequence import Sequence
from tinypaged.engine.request import Draw, Extend, Fork, Plan, Request, completion
from tinypaged.engine.sampling.sampler import has_penalty, seq_seed
from tinypaged.outputs import CompletionOutput
from tinypaged.sampling_params import SamplingParams


class ParallelSampling:
    """Every sequence draws its own token; a request of several sequences forks them after its prompt.

    The first token of each sequence is drawn from the prompt's one logits row, each from its own random
    stream; the other sequences then fork from the prompt's blocks, so the prompt is computed and stored once.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        # Penalties need the output tokens on the host at the next draw: such a token is never deferred.
        self.defer = not has_penalty(params)

    def draws(self, req: Request, seq: Sequence) -> list[Draw]:
        """One draw per sequence; at the first token of a request of k sequences, k draws from the prompt's
        row (draw i > 0 starts output i as a fork)."""
        p = self.params
        if p.num_seqs > 1 and len(req.group.seqs) == 1 and seq.num_tokens == seq.prompt_len:
            forks = [
                Draw(seq, seq_seed(p.seed, i) if p.seed is not None else None, fork=i)
                for i in range(1, p.num_seqs)
            ]
            return [Draw(seq, req.states[seq.seq_id].seed_key), *forks]
        return [Draw(seq, req.states[seq.seq_id].seed_key, None, False, self.defer)]

    def plan(self, req: Request, results: list[tuple[Draw, Any]]) -> Plan:
        """Each token extends its sequence or starts its fork."""
        if len(results) == 1 and results[0][0].fork is None:  # the common case: one draw, no fork
            draw, sample = results[0]
            if draw.spec:  # a verification: the accepted proposals and one drawn token
                return Plan([Extend(draw.seq, s) for s in sample])
            return Plan([Extend(draw.seq, sample)])
        extend: list[Extend] = []
        forks: list[Fork] = []
        for draw, sample in results:
            target = draw.seq if draw.fork is None else Fork(draw.seq, draw.fork)
            if isinstance(target, Fork):
                forks.append(target)
            extend += [Extend(target, s) for s in sample] if draw.spec else [Extend(target, sample)]
        return Plan(extend, forks)

    def outputs(self, req: Request) -> list[CompletionOutput]:
        """Every sequence; with best_of > n, the n of highest cumulative logprob once all are done."""
        p, group = req.params, req.group
        seqs = group.seqs
        if p.num_seqs > p.n:
            if group.is_finished():
                seqs = sorted(seqs, key=lambda s: req.states[s.seq_id].cumulative_logprob, reverse=True)
            seqs = seqs[: p.n]
        return [completion(p, s, req.states[s.seq_id], i) for i, s in enumerate(seqs)]
