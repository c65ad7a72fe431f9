"""The acceptance switch's arithmetic (engine/speculative/switch.py): the k it picks against the expected gain,
the acceptance estimate from tested proposals only, the probes (backing off) that let a switched-off sequence
come back."""

from __future__ import annotations

from tinypaged.engine.speculative.switch import (
    PROBE_EVERY,
    VERIFY_COSTS,
    AcceptanceSwitch,
    best_k,
    expected_gain,
    line_costs,
    verify_costs,
)


def test_best_k_follows_the_expected_gain() -> None:
    c = line_costs(8, 0.1)
    assert best_k(0.0, 4, c) == 0 and best_k(1.0, 4, c) == 4
    assert best_k(0.15, 4, c) == 1 and best_k(0.05, 4, c) == 0  # crossover at alpha = cost for k = 1
    assert best_k(0.9, 4, line_costs(4, 2.0)) == 0  # a draft dearer than the step it saves never pays
    c = line_costs(8, 0.12)
    for alpha in (0.2, 0.5, 0.8):
        k = best_k(alpha, 8, c)
        assert all(expected_gain(alpha, k, c) >= expected_gain(alpha, j, c) for j in range(9))


def test_a_verification_steps_own_cost_raises_the_crossover() -> None:
    """A verification step's own cost (0.66 decode steps on the H200 in run 74, 0.35 in run 85, 0.17 in runs
    95-97) raises the crossover; the device's line is the measured one."""
    assert best_k(0.5, 4, line_costs(4, 0.02)) == 4 and best_k(0.5, 1, line_costs(1, 0.02, 0.66)) == 0
    assert best_k(0.8, 6, line_costs(6, 0.02, 0.66)) >= 4  # 3.4+ tokens for 1.74 steps
    assert expected_gain(0.3, 2, line_costs(2, 0.02, 0.66)) < 1.0 < expected_gain(0.3, 2, line_costs(2, 0.02))
    assert verify_costs("cuda", 3) == line_costs(3, 0.005, 0.17)


def test_a_step_in_the_cost_table_moves_k() -> None:
    """The CPU's table jumps at 4 rows (k = 3): copied text's acceptance picks k = 2, not the 3 a line would;
    near-certain acceptance still takes the largest k; past the table the last increment repeats; a draft's
    token cost adds up by k."""
    c = verify_costs("cpu", 8)
    assert c[: len(VERIFY_COSTS["cpu"])] == VERIFY_COSTS["cpu"]
    slope = VERIFY_COSTS["cpu"][-1] - VERIFY_COSTS["cpu"][-2]
    assert abs(c[7] - c[6] - slope) < 1e-9 and abs(c[8] - c[7] - slope) < 1e-9
    assert best_k(0.66, 4, c) == 2 and best_k(0.66, 4, line_costs(4, 0.12)) > 2
    assert best_k(0.97, 6, c) == 6
    assert verify_costs("cpu", 2, 0.5) == (1.0, c[1] + 0.5, c[2] + 1.0)


def test_estimate_counts_tested_proposals_and_probes() -> None:
    switch = AcceptanceSwitch(line_costs(4, 0.12))
    assert switch.k_for(7, 4) == 4  # optimistic start
    switch.observe(7, 4, 4)
    assert switch.alpha(7) == 1.0
    for _ in range(12):  # always wrong: one tested token each, the rest untested
        switch.observe(7, 4, 0)
    assert switch.alpha(7) < 0.05
    ks = [switch.k_for(7, 4) for _ in range(7 * PROBE_EVERY)]  # refused probes: each waits twice as long
    assert [i + 1 for i, k in enumerate(ks) if k] == [PROBE_EVERY, 3 * PROBE_EVERY, 7 * PROBE_EVERY]
    assert set(ks) == {0, 1}
    switch.observe(7, 1, 1)  # an accepted probe: back on
    assert switch.k_for(7, 4) >= 1
    switch.retain({8})
    assert switch.alpha(7) == 1.0
