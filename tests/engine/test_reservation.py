"""The Orca reservation policies on the default model: the memory policy changes neither the tokens nor the
engine's other behaviour, only how many sequences fit and how much of the cache is wasted."""

from __future__ import annotations

from pathlib import Path

import pytest

from tinypaged import LLM, SamplingParams
from tinypaged.errors import ConfigError

PROMPTS = ["The capital of France is", "One, two, three,", "def fib(n):", "Paging is"]
# Exactly max_tokens each (EOS ignored): orca-oracle's reservation is then the true output length.
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SMALL = {"max_model_len": 256, "num_gpu_blocks_override": 24, "block_size": 16}


def _run(model_dir: Path, policy: str, **kw: object) -> tuple[list, list, LLM]:
    """Generate PROMPTS under `policy`: (token ids per request, StepStats per step, the LLM)."""
    llm = LLM(model=model_dir, kv_reservation=policy, async_scheduling=False, **(SMALL | kw))
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add(engine.process_inputs(f"r{i}", prompt, PARAMS))
    finals, steps = {}, []
    while engine.has_unfinished_requests():
        result = engine.step()
        steps.append(result.stats)
        finals.update((o.request_id, o) for o in result.outputs if o.finished)
    outs = [finals[f"r{i}"] for i in range(len(PROMPTS))]
    assert llm.engine.kv.num_free_gpu_blocks == llm.engine.kv.num_gpu_blocks  # every extent given back
    return [o.outputs[0].token_ids for o in outs], steps, llm


@pytest.fixture(scope="module")
def paged(model_dir: Path) -> tuple[list, list]:
    tokens, steps, _ = _run(model_dir, "paged")
    return tokens, steps


@pytest.mark.parametrize("policy", ["orca-oracle", "orca-pow2", "orca-max"])
def test_orca_policies_generate_the_same_tokens(
    model_dir: Path, paged: tuple[list, list], policy: str
) -> None:
    tokens, steps, llm = _run(model_dir, policy)
    assert tokens == paged[0]
    assert not llm.config.enable_prefix_caching  # forced off: Orca shares nothing
    # orca-max reserves max_model_len (16 blocks) each: one of the four at a time in 24 blocks; paged all four.
    most = max(s.num_seqs for s in steps)
    if policy == "orca-max":
        assert most == 1 < max(s.num_seqs for s in paged[1])
    waste = [s.num_reserved_unused_slots + s.num_internal_waste_slots for s in steps]
    paged_waste = [s.num_reserved_unused_slots + s.num_internal_waste_slots for s in paged[1]]
    assert all(s.num_reserved_unused_slots == 0 and s.num_external_free_blocks == 0 for s in paged[1])
    assert all(0 <= s.num_internal_waste_slots < 16 * s.num_seqs + 16 for s in paged[1] if s.num_seqs)
    if policy == "orca-max":
        assert max(waste) > 4 * max(paged_waste)


def test_parallel_samples_each_reserve_an_extent(model_dir: Path) -> None:
    """n = 3 greedy samples under orca-oracle: each its own extent (the fork copies the prompt's blocks), and the
    same tokens as paged."""
    params = SamplingParams(temperature=0.0, max_tokens=6, n=3, ignore_eos=True)
    want = LLM(model=model_dir, **SMALL).generate(PROMPTS[:1], params)[0]
    got = LLM(model=model_dir, kv_reservation="orca-oracle", **SMALL).generate(PROMPTS[:1], params)[0]
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]


def test_bad_policy_and_too_large_request(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="orca-oracle"):
        LLM(model=model_dir, kv_reservation="orca")
    # orca-max reserves 256 tokens = 16 blocks; a cache of 8 can never hold one: it ends, never stalls.
    llm = LLM(model=model_dir, kv_reservation="orca-max", **(SMALL | {"num_gpu_blocks_override": 8}))
    out = llm.generate(PROMPTS[:1], PARAMS)[0]
    assert out.finished and not out.outputs[0].token_ids
    # max_model_len 64: one extent is 4 blocks of the 8, but a beam search of width 3 needs 12 at once.
    llm = LLM(
        model=model_dir,
        kv_reservation="orca-max",
        **(SMALL | {"num_gpu_blocks_override": 8, "max_model_len": 64}),
    )
    beams = SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate(PROMPTS[:1], PARAMS)[0].outputs[0].token_ids) == 12
    out = llm.generate(PROMPTS[:1], beams)[0]
    assert out.finished and "reservations do not fit" in (out.error or "")
