"""The acceptance-driven switch: per sequence, how many tokens to propose in a step (down to none) from its recent
acceptance and the cost of verifying them, so that speculation is never expected to be slower than decoding one
token a step. It only changes what is proposed: verification, and so the output, is untouched.

Model (Leviathan et al.): each proposal is accepted with probability alpha, so k proposals emit
E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) tokens in one step, which costs C(k) one-row decode steps (C(0) = 1):
the verification step of k + 1 rows, plus the proposer's cost of k tokens (0 for n-gram lookup and the oracle; a
draft model's weight bytes over the target's, since a batch-1 decode reads every weight once). The switch
proposes the k in 1..K with the best E / C(k) when that beats 1, else none.

C(k) is measured per device (`verify_costs`). On the H200 it is a line, 1 + s + c k: s what a verification step
costs beyond a decode step whatever its k (`VERIFY_STEP_COST`), c one more verified row (`VERIFY_ROW_COST`). On
the CPU it is a step function, a table (`VERIFY_COSTS`): torch's float32 matmul reads the weights as a
matrix-vector product up to 3 rows and repacks them from 4 on, so a verification of 2 or 3 rows costs about a
decode step and one of 4 to 7 half as much again; with a line the switch chose k = 4 where k = 2 emits more per
second at the acceptance of copied text (docs/speculative.md).

Alpha per sequence is estimated from the proposals that were tested: each accepted one a success, the first
rejected one a failure, those after it untested (accepted / proposed would count them as failures); an exponential
average over tested tokens (weight `WEIGHT`) that starts at 1, so a sequence's first proposal runs at full k.
While a sequence proposes nothing it probes with one token after `PROBE_EVERY` decode steps, then after twice as
many each time a probe is refused (up to `MAX_PROBE_EVERY`), so that text that turns copyable brings it back (one
accepted probe lifts alpha from 0 to `WEIGHT`, above the CPU's crossover) while one that never does costs little.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

# A verification step's cost beyond a decode step whatever its k, and one more verified row's cost, in one-row
# decode steps at batch 1. CUDA: the H200 at batch 1 on the 8B shape (runs 95-97, the oracle at alpha 0), a
# verification step 1.14-1.24 decode steps at k = 1 and 1.16-1.19 at k = 4: a fixed 0.17 (the step runs in a
# mixed-step graph of 16 rows, its host work not overlapped) and no measurable cost a row (0.005 kept, so that
# the line rises with k). It was 0.35 and 0.02 before the 16-row matmuls left cuBLAS (run 85), 0.66 in run 74.
VERIFY_STEP_COST = {"cuda": 0.17}
VERIFY_ROW_COST = {"cuda": 0.005}
# Measured tables, C(k) for k = 0, 1, ...: the CPU's, the default model (f32, 2 cores, quiet) by the oracle at
# alpha 0 with the switch off, the median step over two prompts against the median decode step (32.4 ms) on
# 2026-12-03 (benchmarks/HISTORY.md, "Verification's cost by k on the CPU"). Past the table, the last step's
# increment repeats.
VERIFY_COSTS = {"cpu": (1.0, 1.06, 1.12, 1.54, 1.60, 1.63, 1.78)}
WEIGHT = 0.25
PROBE_EVERY = 8
MAX_PROBE_EVERY = 64


def line_costs(max_k: int, row_cost: float, step_cost: float = 0.0) -> tuple[float, ...]:
    """C(k) = 1 + step_cost + row_cost k for k = 1..max_k (C(0) = 1)."""
    return (1.0, *(1.0 + step_cost + row_cost * k for k in range(1, max_k + 1)))


def verify_costs(
    device_type: str, max_k: int, token_cost: float = 0.0, table: Sequence[float] | None = None
) -> tuple[float, ...]:
    """C(k) for k = 0..max_k on a device of this type (`table`, measured on this machine, else the type's stored
    table, else its line; an unknown type takes CUDA's), the proposer's `token_cost` a proposed token added."""
    if table is None:
        table = VERIFY_COSTS.get(device_type)
    if table is None:
        step = VERIFY_STEP_COST.get(device_type, VERIFY_STEP_COST["cuda"])
        costs = line_costs(max_k, VERIFY_ROW_COST.get(device_type, VERIFY_ROW_COST["cuda"]), step)
    else:
        slope = table[-1] - table[-2]
        costs = tuple(
            table[k] if k < len(table) else table[-1] + slope * (k - len(table) + 1) for k in range(max_k + 1)
        )
    return tuple(c + token_cost * k for k, c in enumerate(costs))


def expected_gain(alpha: float, k: int, costs: Sequence[float]) -> float:
    """Tokens a step with k proposals emits over its cost C(k), in one-row decode steps (1 for k = 0)."""
    if k == 0:
        return 1.0
    tokens = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return tokens / costs[k]


def best_k(alpha: float, max_k: int, costs: Sequence[float]) -> int:
    """The k in 0..max_k with the best expected gain (0: proposing does not pay at this acceptance)."""
    best, gain = 0, 1.0
    for k in range(1, min(max_k, len(costs) - 1) + 1):
        g = expected_gain(alpha, k, costs)
        if g > gain:
            best, gain = k, g
    return best


class AcceptanceSwitch:
    """Per sequence: its acceptance estimate and how many tokens it proposes next; see the module docstring."""

    def __init__(self, costs: Sequence[float]) -> None:
        self.costs = tuple(costs)  # C(k) for k = 0..K: a verification of k proposals, proposing included
        self._alpha: dict[int, float] = {}
        self._idle: dict[int, int] = {}  # decode steps proposing nothing since the last probe
        self._every: dict[int, int] = {}  # steps between probes, doubled by each refused one

    def alpha(self, seq_id: int) -> float:
        """The sequence's acceptance estimate (1 before any proposal was tested)."""
        return self._alpha.get(seq_id, 1.0)

    def k_for(self, seq_id: int, room: int) -> int:
        """How many tokens (at most `room`) the sequence proposes this step: 0 while it does not pay, but one
        every PROBE_EVERY steps."""
        k = best_k(self.alpha(seq_id), room, self.costs)
        if k or room <= 0:
            self._idle.pop(seq_id, None)
            return k
        idle = self._idle.get(seq_id, 0) + 1
        every = self._every.get(seq_id, PROBE_EVERY)
        if idle < every:
            self._idle[seq_id] = idle
            return 0
        # A probe; the next waits twice as long unless one is accepted (observe), so probing a sequence that
        # keeps refusing them costs at most a verified row every MAX_PROBE_EVERY steps.
        self._idle[seq_id] = 0
        self._every[seq_id] = min(2 * every, MAX_PROBE_EVERY)
        return 1

    def observe(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A verification: `proposed` tokens, the first `accepted` of them accepted."""
        if not proposed:
            return
        if accepted:
            self._every.pop(seq_id, None)
        a = self.alpha(seq_id)
        for _ in range(accepted):
            a += WEIGHT * (1.0 - a)
        if accepted < proposed:
            a -= WEIGHT * a
        self._alpha[seq_id] = a

    def retain(self, seq_ids: Collection[int]) -> None:
        """Forget every sequence not in `seq_ids` (ended, or preempted by recompute)."""
        for d in (self._alpha, self._idle, self._every):
            for seq_id in [s for s in d if s not in seq_ids]:
                del d[seq_id]
