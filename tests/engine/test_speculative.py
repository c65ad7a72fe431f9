"""Speculative decoding end to end on the default model (float32, CPU): greedy outputs and their logprobs equal
the engine's without speculation (penalties, stop strings and max_tokens included), under forced preemption by
recompute and by swap, with n > 1 and prefix caching, and under async scheduling; the KV cache's invariants
hold after every step; seeded sampling repeats; the dynamic switch and the counters; bad input is refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tinypaged import LLM, SamplingParams
from tinypaged.errors import ConfigError, RequestError
from tinypaged.sampling_params import StructuredOutputsParams

TEXT = (
    "The river runs past the old mill, under the stone bridge, and into the quiet valley where the farmers "
    "keep their sheep."
)
PROMPTS = [
    f"Copy this sentence exactly.\nSentence: {TEXT}\nCopy: {TEXT[:30]}",
    "List the numbers: 1, 2, 3, 4, 5, 6, 7,",
    "The capital of France is",
    f"Quote: '{TEXT}'. Again: '",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture
def run(generate_with_stats):  # noqa: ANN001, ANN201
    """`run(llm, prompts, params) -> (outputs, step stats)`, the KV cache's invariants checked after every step."""
    return lambda llm, prompts, params: generate_with_stats(llm.engine, prompts, params, check=True)


@pytest.fixture(scope="module")
def spec_llm(model_dir: Path) -> LLM:
    """Async scheduling on (the GPU's default): speculation composes with it."""
    return LLM(model=model_dir, seed=0, speculative_config=NGRAM, async_scheduling=True)


GREEDY = [
    SamplingParams(temperature=0.0, max_tokens=16, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.2),
    SamplingParams(temperature=0.0, max_tokens=5),
    SamplingParams(temperature=0.0, max_tokens=24, stop=["valley"], min_tokens=3),
]


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list:
    return llm.generate(PROMPTS, GREEDY)


def test_greedy_is_lossless(run, spec_llm: LLM, reference: list) -> None:
    outs, steps = run(spec_llm, PROMPTS, GREEDY)
    for got, want in zip(outs, reference, strict=True):
        g, w = got.outputs[0], want.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert len(outs[2].outputs[0].token_ids) == 5
    for g, w in zip(outs[0].outputs[0].logprobs, reference[0].outputs[0].logprobs, strict=True):
        assert g.keys() == w.keys()
        assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 and g[t].rank == w[t].rank for t in g)
    drafted = sum(s.num_draft_tokens for s in steps)
    accepted = sum(s.num_accepted_tokens for s in steps)
    assert 0 < accepted < drafted  # some proposals accepted, some rejected and rolled back
    assert sum(s.accepted_by_position[0] for s in steps if s.accepted_by_position) > 0
    assert len(steps) < max(len(o.outputs[0].token_ids) for o in outs)  # several tokens a step
    stats = spec_llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens >= accepted and stats.spec_decode_num_draft_tokens >= drafted


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_during_speculation(run, model_dir: Path, reference: list, mode: str) -> None:
    small = LLM(
        model=model_dir,
        speculative_config=NGRAM,
        block_size=8,
        num_gpu_blocks_override=12,
        preemption_mode=mode,
        swap_space=0.2,
        enable_prefix_caching=False,
    )
    outs, steps = run(small, PROMPTS[:3], GREEDY[:3])
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference[:3]]
    assert sum(s.num_preempted for s in steps) > 0
    assert sum(s.num_accepted_tokens for s in steps) > 0


def test_n_and_seeds_with_prefix_caching(run, spec_llm: LLM) -> None:
    params = SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=11, max_tokens=10)
    first, steps = run(spec_llm, PROMPTS[:1] * 2, [params] * 2)  # a repeated prompt: prefix-cache hits
    again, _ = run(spec_llm, PROMPTS[:1], [params])
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in first[0].outputs]
    assert [c.token_ids for c in first[1].outputs] == [c.token_ids for c in first[0].outputs]
    assert sum(s.num_draft_tokens for s in steps) > 0 and sum(s.num_blocks_copied for s in steps) > 0


def test_disable_by_batch_size(run, spec_llm: LLM) -> None:
    speculator = spec_llm.engine.speculator
    spec = speculator.spec
    speculator.spec = replace(spec, disable_by_batch_size=1)
    try:
        short = SamplingParams(temperature=0.0, max_tokens=3)
        long = SamplingParams(temperature=0.0, max_tokens=14)
        _, steps = run(spec_llm, PROMPTS[:2], [long, short])
    finally:
        speculator.spec = spec
    running_two = [s for s in steps if s.num_seqs == 2]
    assert running_two and all(s.num_draft_tokens == 0 for s in running_two)
    assert sum(s.num_draft_tokens for s in steps if s.num_seqs == 1) > 0


def test_bad_input(model_dir: Path, tmp_path: Path, tiny_hf_model) -> None:  # noqa: ANN001
    for bad, words in [
        ({"method": "eagle", "num_speculative_tokens": 2}, "unknown method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "unknown key 'bogus'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
    ]:
        with pytest.raises(ConfigError, match=words):
            LLM(model=model_dir, speculative_config=bad)
    other = tiny_hf_model(tmp_path / "draft", "Llama", vocab_size=1000)
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(model=model_dir, speculative_config={"model": str(other), "num_speculative_tokens": 2})


def test_beam_search_is_refused(spec_llm: LLM) -> None:
    beams = SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, max_tokens=4)
    with pytest.raises(RequestError) as e:
        spec_llm.generate(["hello"], beams)
    assert e.value.param == "use_beam_search"
    assert not spec_llm.engine.has_unfinished_requests()


def test_oracle_proposer(run, model_dir: Path, reference: list) -> None:
    oracle = {"method": "oracle", "num_speculative_tokens": 3, "acceptance_rate": 1.0}
    llm = LLM(model=model_dir, speculative_config=oracle)
    proposer = llm.engine.speculator.proposer
    proposer.add_reference(reference[0].prompt_token_ids, reference[0].outputs[0].token_ids)
    for alpha, params in ((1.0, GREEDY[0]), (0.0, GREEDY[2])):
        proposer.alpha = alpha
        outs, steps = run(llm, PROMPTS[:1], [params])
        assert outs[0].outputs[0].token_ids == reference[0].outputs[0].token_ids[: params.max_tokens]
        drafted = sum(s.num_draft_tokens for s in steps)
        accepted = sum(s.num_accepted_tokens for s in steps)
        assert drafted > 0 and accepted == (drafted if alpha == 1.0 else 0)


def test_draft_model_proposer(run, tmp_path: Path, tiny_hf_model) -> None:  # noqa: ANN001
    """A tiny random target drafting for itself (its own directory as the draft): its draft KV cache is paged,
    rolled back and freed; greedy proposals are nearly all accepted, outputs lossless, seeds repeat."""
    tiny = tiny_hf_model(tmp_path / "tiny", "Llama", max_position_embeddings=128)
    prompts = [{"prompt_token_ids": [5, 9, 200, 7, 5, 9]}, {"prompt_token_ids": list(range(30, 50))}]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(model=tiny, block_size=4).generate(prompts, greedy)
    draft = {"method": "draft_model", "model": str(tiny), "num_speculative_tokens": 3}
    llm = LLM(model=tiny, block_size=4, speculative_config=draft)
    outs, steps = run(llm, prompts, [greedy] * 2)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    drafted = sum(s.num_draft_tokens for s in steps)
    assert drafted > 0 and sum(s.num_accepted_tokens for s in steps) >= 0.9 * drafted
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in run(llm, prompts, [seeded] * 2)[0]] for _ in range(2)]
    assert runs[0] == runs[1]
    proposer = llm.engine.speculator.proposer
    proposer.kv.check_integrity()
    assert not proposer._mirror or all(b.ref_count >= 0 for b in proposer.kv.gpu_pool.blocks)
    # The warm-up runs the draft over a catch-up of 17 and 16 tokens, then decodes, and gives its blocks back.
    calls: list[list[int]] = []
    forward = proposer._forward
    proposer._forward = lambda mirrors, feed: calls.append([len(t) for t in feed]) or forward(mirrors, feed)
    free = proposer.kv.num_free_gpu_blocks
    llm.engine.speculator.warm_up()
    assert calls == [[17, 16], [1, 1], [1]] and proposer.kv.num_free_gpu_blocks == free
    proposer.kv.check_integrity()


def test_structured_outputs_speculate_and_roll_back(run, spec_llm: LLM, llm: LLM) -> None:
    """A grammar masks every verified position, its matcher advanced through the proposals and rolled back:
    greedy output equal to the engine's without speculation, proposals both accepted and refused."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"],
    }
    prompts = ['JSON: {"name": "abc", "tags": ["abc", "abc"]}. Again:']
    params = SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=schema)
    )
    want = llm.generate(prompts, params)[0].outputs[0]
    outs, steps = run(spec_llm, prompts, [params])
    assert outs[0].outputs[0].token_ids == want.token_ids and outs[0].error is None
    drafted = sum(s.num_draft_tokens for s in steps)
    assert 0 < sum(s.num_accepted_tokens for s in steps) < drafted
    assert sum(s.num_constrained for s in steps) > 0


def test_acceptance_switch(run, model_dir: Path, llm: LLM) -> None:
    """An always-wrong proposer is switched off (a one-token probe now and then), an always-right one stays on;
    greedy outputs are the engine's without speculation either way."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = llm.generate(PROMPTS[:1], params)[0]
    oracle = {"method": "oracle", "num_speculative_tokens": 3, "acceptance_rate": 0.0}
    spec_llm = LLM(model=model_dir, speculative_config=oracle)
    speculator = spec_llm.engine.speculator
    speculator.proposer.add_reference(want.prompt_token_ids, want.outputs[0].token_ids)
    for alpha in (0.0, 1.0):
        speculator.proposer.alpha = alpha
        outs, steps = run(spec_llm, PROMPTS[:1], [params])
        assert outs[0].outputs[0].token_ids == want.outputs[0].token_ids
        drafted = [s.num_draft_tokens for s in steps[1:]]  # after the prefill
        if alpha == 0.0:
            late = drafted[12:]  # the switch is off: a one-token probe every PROBE_EVERY steps
            assert sum(drafted[:3]) >= 6 and max(late) <= 1 and 0 < sum(late) <= len(late) // 4
        else:
            assert all(drafted[:-1]) and sum(s.num_accepted_tokens for s in steps) == sum(drafted)


def test_draft_blocks_swap_with_their_group(run, tmp_path: Path, tiny_hf_model) -> None:  # noqa: ANN001
    """Under forced preemption by swap the draft's blocks are swapped out and back in with their group: outputs
    unchanged, and once the requests end no block is held in either of the draft's pools."""
    tiny = tiny_hf_model(tmp_path / "tiny", "Llama", max_position_embeddings=128)
    prompts = [{"prompt_token_ids": list(range(30 + 7 * i, 42 + 7 * i))} for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    plain = LLM(model=tiny, block_size=4).generate(prompts, greedy)
    draft = {"method": "draft_model", "model": str(tiny), "num_speculative_tokens": 2}
    kw = dict(block_size=4, num_gpu_blocks_override=24, preemption_mode="swap", swap_space=0.01)
    llm = LLM(model=tiny, speculative_config=draft, **kw)
    llm.engine.speculator.switch = None  # a draft as large as its target never pays: propose all the same
    outs, steps = run(llm, prompts, [greedy] * 3)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    proposer = llm.engine.speculator.proposer
    assert sum(s.num_preempted for s in steps) > 0
    assert proposer.num_swap_outs > 0 and proposer.num_swap_ins > 0
    assert sum(s.num_accepted_tokens for s in steps) > 0
    proposer.kv.check_integrity()
    assert proposer.kv.num_free_gpu_blocks == proposer.kv.num_gpu_blocks
    assert proposer.kv.num_free_cpu_blocks == proposer.kv.num_cpu_blocks > 0


def test_draft_memory_shares_the_target_budget(tmp_path: Path, tiny_hf_model) -> None:  # noqa: ANN001
    """A draft model's KV pool and swap pool come out of the target's budget (cpu_kv_cache_space and swap_space
    here; gpu_memory_utilization on a GPU): equal pools, or the draft's capped by disable_by_batch_size with
    the rest the target's. Catch-up passes take at most max_num_batched_tokens tokens, outputs unchanged."""
    tiny = tiny_hf_model(tmp_path / "tiny", "Llama", max_position_embeddings=128)
    space, swap = 2**20, 2**19
    kw = dict(
        block_size=4, cpu_kv_cache_space=space / 2**30, swap_space=swap / 2**30, max_num_batched_tokens=24
    )
    plain = LLM(model=tiny, **kw)
    bb = plain.engine.runner.block_bytes
    assert plain.engine.runner.num_gpu_blocks == space // bb
    draft = {"method": "draft_model", "model": str(tiny), "num_speculative_tokens": 2}
    llm = LLM(model=tiny, speculative_config=draft, **kw)
    runner, proposer = llm.engine.runner, llm.engine.speculator.proposer
    dbb = runner.draft.block_bytes
    assert dbb == bb  # the tiny model drafts for itself
    assert runner.num_gpu_blocks == proposer.kv.num_gpu_blocks == space // (bb + dbb)
    assert runner.num_cpu_blocks == proposer.kv.num_cpu_blocks == swap // (bb + dbb)
    assert proposer.cache.numel() * proposer.cache.element_size() == proposer.kv.num_gpu_blocks * dbb
    capped = LLM(model=tiny, speculative_config={**draft, "disable_by_batch_size": 1}, **kw)
    runner = capped.engine.runner
    assert runner.num_draft_blocks == 128 // 4 + 1
    assert runner.num_gpu_blocks == (space - runner.num_draft_blocks * dbb) // bb
    # A 60-token prompt: the draft catches up in passes of at most 24 tokens.
    calls: list[int] = []
    forward = proposer._forward
    proposer._forward = lambda mirrors, feed: calls.append(sum(map(len, feed))) or forward(mirrors, feed)
    llm.engine.speculator.switch = None
    prompts = [{"prompt_token_ids": list(range(40, 100))}, {"prompt_token_ids": list(range(7, 40))}]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    assert max(calls) <= 24 and sum(calls) >= 60 + 33
    proposer.kv.check_integrity()


def test_cpu_costs_are_measured_once_a_process(spec_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU engine's acceptance switch takes C(k) measured on this machine (engine/speculative/costs.py): one
    per k up to num_speculative_tokens, a decode step's own 1.0 first; the same model and k measured again in
    the process get the same table (a seeded request's output follows the k its steps propose);
    TINYPAGED_SPEC_COSTS=table leaves the switch the stored table."""
    from tinypaged.engine.speculative import costs

    runner = spec_llm.engine.runner
    k = NGRAM["num_speculative_tokens"]
    got = spec_llm.engine.speculator.switch.costs
    assert len(got) == k + 1 and got[0] == 1.0 and all(0.0 < c < 100.0 for c in got)
    monkeypatch.setattr(costs, "_measure", lambda *a: pytest.fail("measured again"))
    assert costs.measured_costs(runner, k) == got
    monkeypatch.setenv("TINYPAGED_SPEC_COSTS", "table")
    assert costs.measured_costs(runner, k) is None
