"""Async scheduling (each step queued before the previous step's tokens are applied) changes no output.

On the CPU the engine is synchronous by default; these tests turn async scheduling on and compare with the
synchronous engine on the same requests: greedy and seeded sampling, stop strings, penalties, logprobs,
n > 1 and beam search in one batch, under forced preemption by recompute and by swap, with chunked prefill,
and with requests aborted while their step is in flight. Every KV block is back in the pool at the end.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tinypaged import LLM, SamplingParams
from tinypaged.engine.step.llm_engine import LLMEngine

WORDS = "the a river mountain quickly blue seven engine paged memory block table copy write token".split()


def _prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))) for _ in range(n)]


# A shared opening of two full blocks or so, for the prefix-caching case.
PROMPTS = [" ".join(WORDS * 2) + " " + p for p in _prompts(20, 1)]
# One of each kind, cycled over the prompts; every random draw is seeded, so outputs are reproducible.
KINDS = [
    SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, seed=3, n=2, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=24, stop=[" the", "block"]),
    SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.3, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=11, max_tokens=8, logprobs=3, min_tokens=4),
    SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),
    SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=6, ignore_eos=True),
]
PARAMS = [KINDS[i % len(KINDS)] for i in range(len(PROMPTS))]


def _summary(outs) -> list:  # noqa: ANN001
    return [
        [(o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs) for o in out.outputs]
        for out in outs
    ]


def _assert_clean(engine: LLMEngine) -> None:
    engine.check_integrity()
    stats = engine.stats()
    assert (
        stats.num_free_gpu_blocks == stats.num_gpu_blocks
        and stats.num_free_cpu_blocks == stats.num_cpu_blocks
    )
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list:
    """The synchronous engine with a roomy cache."""
    llm = LLM(model=model_dir, async_scheduling=False)
    assert not llm.engine.async_scheduling
    return _summary(llm.generate(PROMPTS, PARAMS))


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"num_gpu_blocks_override": 20, "preemption_mode": "recompute"},
        {"num_gpu_blocks_override": 20, "preemption_mode": "swap", "swap_space": 0.5},
        {"max_num_batched_tokens": 24, "max_num_seqs": 6},
        {"enable_prefix_caching": True, "max_num_batched_tokens": 64},
    ],
    ids=["roomy", "recompute", "swap", "chunked", "prefix-caching"],
)
def test_async_outputs_match_sync(
    model_dir: Path, reference: list, kwargs: dict, generate_with_stats
) -> None:
    llm = LLM(model=model_dir, async_scheduling=True, **kwargs)
    outs, steps = generate_with_stats(llm.engine, PROMPTS, PARAMS)
    got = _summary(outs)
    if not kwargs:
        # The same batches as the synchronous engine: bit for bit the same results, logprobs included.
        assert got == reference
    else:
        # Preemption and chunking batch differently, and batch composition moves logits by float rounding,
        # which can tip a random draw between near-equal tokens: compare what does not depend on it.
        for i, p in enumerate(PARAMS):
            if p.temperature == 0.0:
                assert [o[:4] for o in got[i]] == [o[:4] for o in reference[i]], f"request {i}"
            else:
                assert [len(o[0]) for o in got[i]] == [len(o[0]) for o in reference[i]], f"request {i}"
    deferred = sum(1 for st in steps if st.num_draws and st.deferred)
    at_once = sum(1 for st in steps if st.num_draws and not st.deferred)
    # A deferred step's tokens are applied by the next call, first.
    assert all(st.applied_steps[0] == st.step - 1 for st in steps if st.step and steps[st.step - 1].deferred)
    sched = llm.engine.scheduler
    print(
        f"\n{kwargs}: {deferred} deferred steps, {at_once} applied at once, {sched.num_preemptions} preemptions"
    )
    assert deferred > 0 and at_once > 0  # beam search and penalties keep some steps synchronous
    if "preemption_mode" in kwargs:
        assert sched.num_preemptions > 0
    if kwargs.get("enable_prefix_caching"):
        assert llm.engine.stats().prefix_cache_hits_total > 0  # the prompts share their first words
    _assert_clean(llm.engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_while_token_pending(
    model_dir: Path, reference: list, mode: str, generate_with_stats
) -> None:
    """Greedy requests only (every step deferred) in a cache so small that sequences are preempted with
    their last token still on the device: they get it before they run again, and outputs do not change."""
    ids = [i for i, p in enumerate(PARAMS) if p is KINDS[0] or p is KINDS[6]]
    llm = LLM(model=model_dir, async_scheduling=True, num_gpu_blocks_override=8, preemption_mode=mode)
    outs, steps = generate_with_stats(llm.engine, [PROMPTS[i] for i in ids], [PARAMS[i] for i in ids])
    assert _summary(outs) == [reference[i] for i in ids]  # greedy, no logprobs: equal even in other batches
    pending_at_preemption = [st.num_preempted_pending for st in steps if st.num_preempted]
    print(
        f"\n{mode}: tokens pending at the {len(pending_at_preemption)} preemptions: {pending_at_preemption}"
    )
    assert any(pending_at_preemption)
    _assert_clean(llm.engine)


def test_abort_while_in_flight(model_dir: Path, reference: list) -> None:
    engine = LLM(model=model_dir, async_scheduling=True).engine
    ids = [i for i, p in enumerate(PARAMS) if p is KINDS[0] or p is KINDS[6]][:4]  # greedy, no stop strings
    for i in ids:
        engine.add_request(str(i), PROMPTS[i], PARAMS[i])
    finals = {}
    aborted = None
    victim = str(ids[1])
    while engine.has_unfinished_requests():
        result = engine.step()
        finals.update((o.request_id, o) for o in result.outputs if o.finished)
        if aborted is None and result.stats.deferred and result.stats.num_draws == len(ids):
            group = engine.scheduler.get_seq_group(victim)
            assert group is not None and group.seqs[0].num_pending == 1
            aborted = engine.abort_request(victim)  # its sampled token is still on the device
    assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    assert victim not in finals
    for i in ids:
        if str(i) != victim:
            assert _summary([finals[str(i)]]) == [reference[i]]
    _assert_clean(engine)
