"""The engine's side of speculative decoding: before each schedule, which sequences speculate and what their
proposer proposes (set as `Sequence.spec_token_ids`, for the scheduler to verify with their last token); the
draft's distributions until the verification reads them; the acceptance counts (vLLM's spec-decode metrics).

A sequence speculates when it is decoding (one token left to compute, none pending on the device), its request
samples in parallel (n, best_of; beam search refuses speculation at its check; a grammar masks each verified
position, `GrammarState.mask`), and
there is room: k is cut so that the output fits max_tokens and the sequence max_model_len. Speculation is off
for a step once more requests are running or waiting than `disable_by_batch_size` (vLLM's switch): at a large
batch the forward pass is no longer bound by reading the weights, and verifying rejected tokens costs compute.
Per sequence, the acceptance switch (switch.py) lowers k, down to none, while its recent acceptance makes
proposing more tokens cost more than they are expected to save.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from tinypaged.config import EngineConfig
from tinypaged.core.scheduler import Scheduler
from tinypaged.core.sequence import Sequence, SequenceStatus
from tinypaged.engine.device.model_runner import ModelRunner
from tinypaged.engine.request import Request
from tinypaged.engine.sampling.parallel_sampling import ParallelSampling
from tinypaged.engine.sampling.rejection import Verified
from tinypaged.engine.speculative.costs import measured_costs
from tinypaged.engine.speculative.proposers import NgramProposer, OracleProposer, Proposer
from tinypaged.engine.speculative.switch import AcceptanceSwitch, verify_costs
from tinypaged.speculative import SpeculativeConfig


@dataclass
class SpecCounters:
    """Acceptance counts (vLLM's spec-decode metrics): draws verified, tokens proposed in them, tokens accepted,
    and accepted tokens by their position in the proposal."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)

    def add(self, proposed: int, accepted: int) -> None:
        """One verified draw: `proposed` tokens, the first `accepted` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_by_position) < proposed:
            self.accepted_by_position += [0] * (proposed - len(self.accepted_by_position))
        for j in range(accepted):
            self.accepted_by_position[j] += 1

    def merge(self, other: SpecCounters) -> None:
        """Add another's counts to these."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for j, n in enumerate(other.accepted_by_position):
            if j == len(self.accepted_by_position):
                self.accepted_by_position.append(0)
            self.accepted_by_position[j] += n

    def as_tuple(self) -> tuple[int, int, int, tuple[int, ...]]:
        """(drafts, draft tokens, accepted tokens, accepted tokens by position): EngineStats' plain data."""
        return (
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            tuple(self.accepted_by_position),
        )

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def make_speculator(config: EngineConfig, runner: ModelRunner) -> Speculator:
    """The speculator of config.speculative with the proposer it names (without one: a speculator that never
    speculates); a draft model loads next to the target's `runner`, on its device."""
    spec = config.speculative
    if spec is None:
        return Speculator(None, None, 0)
    proposer: Proposer
    token_cost = 0.0  # the proposer's cost of one token, in target decode steps (host lookups: nothing)
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec.method == "oracle":
        proposer = OracleProposer(spec.acceptance_rate, config.model_config.vocab_size, config.seed)
    else:
        from tinypaged.engine.speculative.draft_model import DraftModelProposer

        proposer = DraftModelProposer(config, spec, runner)
        token_cost = proposer.token_cost
    assert config.max_model_len is not None
    k = spec.num_speculative_tokens
    # The CPU's C(k) is measured on this machine (costs.py); a GPU's is its stored line.
    switch = AcceptanceSwitch(verify_costs(runner.device.type, k, token_cost, measured_costs(runner, k)))
    return Speculator(spec, proposer, config.max_model_len, switch)


class Speculator:
    """Chooses the speculating sequences each step, asks the proposer, and counts what verification accepts."""

    def __init__(
        self,
        spec: SpeculativeConfig | None,
        proposer: Proposer | None,
        max_model_len: int,
        switch: AcceptanceSwitch | None = None,
    ) -> None:
        self.spec = spec
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.switch = switch  # None: always propose k (benchmarks measure the crossover without it)
        self.totals = SpecCounters()
        self.enabled = spec is not None  # whether this step speculates (disable_by_batch_size)
        self.active = True  # False: never speculate (benchmarks time one engine with and without)
        self._proposed: list[Sequence] = []
        # Per sequence proposing this step: the draft's distributions and the oracle's accepted count (benchmarks)
        self._drafts: dict[int, tuple[torch.Tensor | None, int | None]] = {}
        self._known: set[int] = set()  # the sequences the proposer may keep state for

    def warm_up(self) -> None:
        """Compile what the proposer launches (the engine's warm-up calls it before ready)."""
        if self.proposer is not None:
            self.proposer.warm_up()

    def propose(self, scheduler: Scheduler, requests: Mapping[str, Request]) -> None:
        """Give each eligible decoding sequence of the scheduler's running groups its proposal
        (`spec_token_ids`), unless more requests run or wait than disable_by_batch_size."""
        if self.spec is None or self.proposer is None or not self.active:
            self.enabled = False
            return
        limit = self.spec.disable_by_batch_size
        self.enabled = limit is None or scheduler.num_running + scheduler.num_waiting <= limit
        if not self.enabled:
            return
        batch: list[tuple[Request, Sequence, int]] = []
        switch, running = self.switch, set()
        for group in scheduler.running:
            req = requests.get(group.request_id)
            if req is None or not isinstance(req.strategy, ParallelSampling):
                continue
            for seq in group.seqs:
                running.add(seq.seq_id)
                k = self._room(req, seq)
                if switch is not None and k > 0:
                    k = switch.k_for(seq.seq_id, k)
                if k > 0:
                    batch.append((req, seq, k))
        if switch is not None:
            switch.retain(running)
        if not batch:
            return
        self._known.update(seq.seq_id for _, seq, _ in batch)
        for (_, seq, k), prop in zip(batch, self.proposer.propose(batch), strict=True):
            tokens = tuple(prop.tokens[:k])
            if not tokens:
                continue
            seq.spec_token_ids = tokens
            self._proposed.append(seq)
            if prop.q is not None or prop.accept is not None:
                q = prop.q[: len(tokens)] if prop.q is not None else None
                self._drafts[seq.seq_id] = (q, prop.accept)

    def _room(self, req: Request, seq: Sequence) -> int:
        """How many tokens this sequence may speculate now (0: it does not)."""
        if (
            seq.status != SequenceStatus.RUNNING
            or seq.num_pending
            or seq.num_tokens - seq.num_computed_tokens != 1
        ):
            return 0
        assert self.spec is not None
        k = min(self.spec.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1)
        max_tokens = req.params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - (seq.num_tokens - seq.prompt_len) - 1)
        return k

    def scheduled(self) -> None:
        """The schedule has taken the proposals it verifies: the sequences forget theirs."""
        for seq in self._proposed:
            seq.spec_token_ids = ()
        self._proposed.clear()

    def draft_of(self, seq_id: int) -> tuple[torch.Tensor | None, int | None]:
        """The draft's distributions of this step's proposal for the sequence (None: point masses), and the
        count to accept where the proposer decides it (the oracle; None: verification decides)."""
        return self._drafts.get(seq_id, (None, None))

    def verified(self, results: Iterable[tuple[int, int, Verified]]) -> SpecCounters:
        """Count a step's verifications ((seq id, proposed tokens, result) each), tell the switch, and forget
        their distributions; the step's counts."""
        step = SpecCounters()
        for seq_id, proposed, v in results:
            step.add(proposed, v.num_accepted)
            if self.switch is not None:
                self.switch.observe(seq_id, proposed, v.num_accepted)
        self.totals.merge(step)
        self._drafts.clear()
        return step

    def preempted(self, scheduler: Scheduler, request_ids: Iterable[str]) -> None:
        """The schedule preempted these requests: what the proposer keeps for their sequences on the device
        follows them (swapped out with a group swapped out, dropped with one that will recompute)."""
        if self.proposer is None:
            return
        for request_id in request_ids:
            group = scheduler.get_seq_group(request_id)
            if group is not None:
                swapped = any(s.status == SequenceStatus.SWAPPED for s in group.seqs)
                self.proposer.preempted(group, swapped)

    def idle(self) -> None:
        """No request is left: the proposer forgets every sequence (a draft's blocks all go back)."""
        if self.proposer is not None:
            for seq_id in self._known:
                self.proposer.free(seq_id)
        self._known.clear()
        if self.switch is not None:
            self.switch.retain(())
