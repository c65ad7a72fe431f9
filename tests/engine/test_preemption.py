"""The paged memory manager end to end on the default model: outputs are unchanged when a tiny KV cache
forces many preemptions (by recompute and by swap), and prefix caching skips shared prompt blocks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tinypaged import LLM, SamplingParams
from tinypaged.core.scheduler import SchedulerOutput

WORDS = "the a river mountain quickly blue seven engine paged memory block table copy write token".split()


def _prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 48))) for _ in range(n)]


PROMPTS = _prompts(32, 0)
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _record_steps(llm: LLM) -> list[SchedulerOutput]:
    """Keep every SchedulerOutput the engine produces (the engine calls schedule() once per step)."""
    steps: list[SchedulerOutput] = []
    schedule = llm.engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        steps.append(out)
        return out

    llm.engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return steps


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    """Greedy outputs with the default (roomy) cache: nothing is ever preempted."""
    before = llm.engine.scheduler.num_preemptions
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert llm.engine.scheduler.num_preemptions == before
    return outs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_unchanged_under_preemption(model_dir: Path, reference: list[list[int]], mode: str) -> None:
    # 24 blocks of 16 tokens hold ~6 of the 32 sequences at their full length (up to ~75 tokens each).
    small = LLM(model=model_dir, num_gpu_blocks_override=24, preemption_mode=mode, swap_space=0.5)
    steps = _record_steps(small)
    outs = small.generate(PROMPTS, PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == reference
    sched = small.engine.scheduler
    print(
        f"\n{mode}: {sched.num_preemptions} preemptions, {sched.num_swap_outs} swap-outs, {len(steps)} steps"
    )
    assert sched.num_preemptions > 0
    if mode == "swap":
        assert sched.num_swap_outs > 0 and any(s.blocks_to_swap_in for s in steps)
    else:
        assert sched.num_swap_outs == 0
    kv = small.engine.kv
    kv.check_integrity()
    assert kv.num_free_gpu_blocks == kv.num_gpu_blocks and kv.num_free_cpu_blocks == kv.num_cpu_blocks


def test_chunked_prefill_unchanged(model_dir: Path, reference: list[list[int]]) -> None:
    # A 32-token budget splits most prompts into several chunks, mixed with other sequences' decodes.
    chunked = LLM(model=model_dir, max_num_batched_tokens=32, max_num_seqs=8)
    steps = _record_steps(chunked)
    outs = chunked.generate(PROMPTS[:12], PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == reference[:12]
    assert any(not s.do_sample and s.num_new_tokens > 1 for out in steps for s in out.scheduled)


def test_prefix_caching_skips_shared_blocks(model_dir: Path) -> None:
    shared = " ".join(WORDS * 8)  # ~120 tokens: several full blocks
    prompts = [f"{shared} question {i}: which word comes next?" for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    plain = LLM(model=model_dir)
    cached = LLM(model=model_dir, enable_prefix_caching=True)
    plain_steps, cached_steps = _record_steps(plain), _record_steps(cached)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    # One request first, so its full blocks are in the cache when the others arrive.
    first = cached.generate(prompts[:1], params)
    rest = cached.generate(prompts[1:], params)
    assert [o.outputs[0].token_ids for o in first + rest] == want
    computed_plain = sum(o.num_batched_tokens for o in plain_steps)
    computed_cached = sum(o.num_batched_tokens for o in cached_steps)
    kv = cached.engine.kv
    hit_rate = kv.num_prefix_hit_blocks / max(1, kv.num_prefix_queried_blocks)
    print(
        f"\nprefix caching: {computed_cached} tokens computed vs {computed_plain}; block hit rate {hit_rate:.2f}"
    )
    assert computed_cached < computed_plain - 5 * 96  # five prompts skip at least 6 full blocks each
    assert hit_rate > 0.5
    kv.check_integrity()


def test_prompt_that_can_never_fit_does_not_stall(model_dir: Path) -> None:
    small = LLM(model=model_dir, num_gpu_blocks_override=4)  # 64 tokens in all
    long_prompt = " ".join(WORDS * 10)
    outs = small.generate(["Short prompt here", long_prompt, "Another short one"], PARAMS)
    assert outs[1].error and "KV cache" in outs[1].error
    assert outs[1].outputs[0].token_ids == []
    assert len(outs[0].outputs[0].token_ids) == 16 and len(outs[2].outputs[0].token_ids) == 16
    assert small.engine.kv.num_free_gpu_blocks == 4
