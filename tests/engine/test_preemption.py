"""The paged memory manager end to end on the default model: outputs are unchanged when a tiny KV cache
forces many preemptions (by recompute and by swap), and prefix caching skips shared prompt blocks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tinypaged import LLM, SamplingParams

WORDS = "the a river mountain quickly blue seven engine paged memory block table copy write token".split()


def _prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 48))) for _ in range(n)]


PROMPTS = _prompts(32, 0)
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    """Greedy outputs with the default (roomy) cache: nothing is ever preempted."""
    before = llm.engine.scheduler.num_preemptions
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert llm.engine.scheduler.num_preemptions == before
    return outs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_unchanged_under_preemption(
    model_dir: Path, reference: list[list[int]], mode: str, generate_with_stats
) -> None:
    # 24 blocks of 16 tokens hold ~6 of the 32 sequences at their full length (up to ~75 tokens each).
    small = LLM(model=model_dir, num_gpu_blocks_override=24, preemption_mode=mode, swap_space=0.5)
    outs, steps = generate_with_stats(small.engine, PROMPTS, [PARAMS] * len(PROMPTS))
    assert [o.outputs[0].token_ids for o in outs] == reference
    sched = small.engine.scheduler
    print(
        f"\n{mode}: {sched.num_preemptions} preemptions, {sched.num_swap_outs} swap-outs, {len(steps)} steps"
    )
    assert sched.num_preemptions == sum(s.num_preempted for s in steps) > 0
    if mode == "swap":
        assert sched.num_swap_outs > 0 and any(s.num_blocks_swapped_in for s in steps)
    else:
        assert sched.num_swap_outs == 0 and not any(s.num_blocks_swapped_out for s in steps)
    small.engine.check_integrity()
    stats = small.engine.stats()
    assert (
        stats.num_free_gpu_blocks == stats.num_gpu_blocks
        and stats.num_free_cpu_blocks == stats.num_cpu_blocks
    )


def test_chunked_prefill_unchanged(model_dir: Path, reference: list[list[int]], generate_with_stats) -> None:
    # A 32-token budget splits most prompts into several chunks, mixed with other sequences' decodes.
    chunked = LLM(model=model_dir, max_num_batched_tokens=32, max_num_seqs=8)
    outs, steps = generate_with_stats(chunked.engine, PROMPTS[:12], [PARAMS] * 12)
    assert [o.outputs[0].token_ids for o in outs] == reference[:12]
    assert any(s.num_partial_prefills for s in steps)
    assert any(s.num_partial_prefills and s.num_decode_tokens for s in steps)  # chunks beside decodes
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in steps) <= 32


def test_prefix_caching_skips_shared_blocks(model_dir: Path, generate_with_stats) -> None:
    shared = " ".join(WORDS * 8)  # ~120 tokens: several full blocks
    prompts = [f"{shared} question {i}: which word comes next?" for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    plain = LLM(model=model_dir)
    cached = LLM(model=model_dir, enable_prefix_caching=True)
    want, plain_steps = generate_with_stats(plain.engine, prompts, [params] * 6)
    # One request first, so its full blocks are in the cache when the others arrive.
    first, first_steps = generate_with_stats(cached.engine, prompts[:1], [params])
    rest, rest_steps = generate_with_stats(cached.engine, prompts[1:], [params] * 5)
    assert [o.outputs[0].token_ids for o in first + rest] == [o.outputs[0].token_ids for o in want]

    def computed(steps: list) -> int:
        return sum(s.num_prefill_tokens + s.num_decode_tokens for s in steps)

    computed_plain, computed_cached = computed(plain_steps), computed(first_steps + rest_steps)
    stats = cached.engine.stats()
    hit_rate = stats.prefix_cache_hits_total / max(1, stats.prefix_cache_queries_total)
    print(
        f"\nprefix caching: {computed_cached} tokens computed vs {computed_plain}; block hit rate {hit_rate:.2f}"
    )
    assert computed_cached < computed_plain - 5 * 96  # five prompts skip at least 6 full blocks each
    assert hit_rate > 0.5
    cached.engine.check_integrity()


def test_prompt_that_can_never_fit_does_not_stall(model_dir: Path) -> None:
    small = LLM(model=model_dir, num_gpu_blocks_override=4)  # 64 tokens in all
    long_prompt = " ".join(WORDS * 10)
    outs = small.generate(["Short prompt here", long_prompt, "Another short one"], PARAMS)
    assert outs[1].error and "KV cache" in outs[1].error
    assert outs[1].outputs[0].token_ids == []
    assert len(outs[0].outputs[0].token_ids) == 16 and len(outs[2].outputs[0].token_ids) == 16
    assert small.engine.stats().num_free_gpu_blocks == 4
