"""Proposers: what guesses the tokens after a sequence for the target to verify. The interface takes a step's
sequences at once (a draft model runs them as one batch) and answers each with up to k tokens, and the draft's
distribution at each when it sampled them (None: a point mass, the proposer is deterministic).

`NgramProposer` is vLLM's prompt lookup: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, n from prompt_lookup_max down to prompt_lookup_min. `OracleProposer` (benchmarks)
proposes the target's own greedy continuation, known beforehand, each token kept with probability alpha and
replaced by a wrong one otherwise, at no cost: it measures verification itself. Its acceptance is controlled:
it tells verification how many of its tokens to accept (`Proposal.accept`), so that a pass in bf16, whose
several rows round differently from a one-row pass and so soon leave the one-row reference on a random-weight
model, still accepts alpha's share. Learned heads (EAGLE, MTP) would be proposers too: they answer the same call.
"""

from __future__ import annotations

import random
from typing import NamedTuple, Protocol

import numpy as np
import torch

from tinypaged.core.sequence import Sequence, SequenceGroup
from tinypaged.engine.request import Request


class Proposal(NamedTuple):
    """Tokens proposed to follow a sequence, and the draft's distribution at each `[len(tokens), vocab]` when it
    drew them (None: each is a point mass)."""

    tokens: tuple[int, ...]
    q: torch.Tensor | None = None
    accept: int | None = None  # benchmarks (the oracle): accept this many, whatever the target's rows say


NO_PROPOSAL = Proposal(())


class Proposer(Protocol):
    """Proposes tokens for a step's speculating sequences."""

    def propose(self, batch: list[tuple[Request, Sequence, int]]) -> list[Proposal]:
        """For each (request, sequence, k): at most k tokens to follow the sequence's token_ids."""
        ...

    def free(self, seq_id: int) -> None:
        """The sequence ended or left the GPU: forget any state kept for it."""
        ...

    def preempted(self, group: SequenceGroup, swapped: bool) -> None:
        """The target preempted the group, by swapping it out (`swapped`) or for recompute: state kept on the
        device for its sequences follows it."""
        ...

    def warm_up(self) -> None:
        """Before the server is ready: launch once what proposing launches (a model's kernels compile then)."""
        ...


class NgramProposer:
    """Prompt lookup (vLLM's "ngram"): match the last n tokens earlier in the sequence and propose what followed."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, batch: list[tuple[Request, Sequence, int]]) -> list[Proposal]:
        """The continuation of the latest earlier match of the longest suffix that has one."""
        return [Proposal(ngram_lookup(seq.token_ids, self.min_n, self.max_n, k)) for _, seq, k in batch]

    def free(self, seq_id: int) -> None:
        """Nothing is kept per sequence."""

    def preempted(self, group: SequenceGroup, swapped: bool) -> None:
        """Nothing is kept on the device."""

    def warm_up(self) -> None:
        """Nothing to compile: proposing runs on the host."""


def ngram_lookup(token_ids: list[int], min_n: int, max_n: int, k: int) -> tuple[int, ...]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens (the longest n in
    [min_n, max_n] that occurs earlier); () if none does."""
    total = len(token_ids)
    if total <= min_n or k <= 0:
        return ()
    ids = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # Windows that start before the suffix itself and are followed by at least one token.
        windows = np.lib.stride_tricks.sliding_window_view(ids[: total - 1], n)
        hits = np.flatnonzero((windows == ids[total - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tuple(token_ids[start : start + k])
    return ()


class OracleProposer:
    """Benchmarks only: proposes each sequence's reference continuation (the target's own greedy output, given
    by `add_reference`; past its end, or without one, the last token repeated), and has verification accept
    the leading tokens that each stayed right with probability `alpha`; the first that did not is made wrong.
    The acceptance is the oracle's, not the target's: outputs follow the reference only as far as the target's
    own choices agree with it (always in float32 on the CPU; a bf16 several-row pass may round otherwise)."""

    def __init__(self, alpha: float, vocab_size: int, seed: int = 0) -> None:
        self.alpha = alpha
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)
        self._refs: dict[tuple[int, ...], list[int]] = {}

    def reseed(self, seed: int) -> None:
        """Restart the draws: runs reseeded alike draw alike (a benchmark's k = 4 alone or in a sweep)."""
        self._rng = random.Random(seed)

    def add_reference(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        """The continuation to propose after this prompt (the target's greedy output for it)."""
        self._refs[tuple(prompt_token_ids)] = list(output_token_ids)

    def propose(self, batch: list[tuple[Request, Sequence, int]]) -> list[Proposal]:
        """k tokens per sequence, the first `accept` of them declared right (see `proposal`)."""
        return [self.proposal(seq, k) for _, seq, k in batch]

    def proposal(self, seq: Sequence, k: int) -> Proposal:
        """The reference's next k tokens (padded with the last token); j leading ones kept, each with
        probability alpha, and the one at j, if any, replaced by a wrong one (the next id): accept j."""
        ref = self._refs.get(tuple(seq.token_ids[: seq.prompt_len]), [])
        done = len(seq.token_ids) - seq.prompt_len
        tokens = ref[done : done + k]
        tokens += [tokens[-1] if tokens else seq.token_ids[-1]] * (k - len(tokens))
        j = 0
        while j < k and self._rng.random() < self.alpha:
            j += 1
        if j < k:
            tokens[j] = (tokens[j] + 1) % self.vocab_size
        return Proposal(tuple(tokens), None, j)

    def free(self, seq_id: int) -> None:
        """Nothing is kept per sequence."""

    def preempted(self, group: SequenceGroup, swapped: bool) -> None:
        """Nothing is kept on the device."""

    def warm_up(self) -> None:
        """Nothing to compile: proposing runs on the host."""
