"""One bad request never hurts another: a request whose sampling or update fails inside a step fails alone
(its blocks freed, its output saying so without the fault's text) while the others finish with the tokens they
get alone; values the limits refuse are refused at the door; per-request work stays bounded."""

from __future__ import annotations

import pytest

from tinypaged import LLM, SamplingParams
from tinypaged.engine.sampling.parallel_sampling import ParallelSampling
from tinypaged.engine.sampling.sampler import Sampler
from tinypaged.engine.step.llm_engine import LLMEngine
from tinypaged.errors import RequestError
from tinypaged.limits import MAX_LOGPROB_ENTRIES, MAX_STOP_TOKEN_IDS

VICTIM = 4242  # the seed that marks the request a test makes fail
PROMPTS = ["The capital of France is", "Water boils at", "Once upon a time", "def fibonacci(n):"]


def _params(i: int) -> SamplingParams:
    if i == 1:  # the victim samples (seeded), the others are greedy or seeded too
        return SamplingParams(temperature=0.8, seed=VICTIM, max_tokens=12, ignore_eos=True)
    return SamplingParams(temperature=0.7 * (i % 2), seed=i, max_tokens=12, ignore_eos=True)


def _is_victim(rows) -> bool:  # noqa: ANN001
    # Only once the victim has generated a few tokens: it fails while the others are running.
    return any(r.params.seed == VICTIM and r.generated >= 3 for r in rows)


def _idle_and_clean(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    stats = engine.stats()
    assert (
        stats.num_free_gpu_blocks == stats.num_gpu_blocks
        and stats.num_free_cpu_blocks == stats.num_cpu_blocks
    )


@pytest.fixture(scope="module")
def alone(llm: LLM) -> dict[int, list[int]]:
    """Each request's tokens when it runs by itself."""
    return {i: llm.generate(p, _params(i))[0].outputs[0].token_ids for i, p in enumerate(PROMPTS) if i != 1}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["sampler", "update"])
def test_one_failing_request_fails_alone(
    llm: LLM, alone: dict, generate_with_stats, monkeypatch, async_scheduling: bool, where: str
) -> None:
    engine = llm.engine
    if where == "sampler":
        real_sample = Sampler.sample

        def sample(self, logits, rows, need_logprobs=False):  # noqa: ANN001, ANN202
            if _is_victim(rows):
                raise RuntimeError("injected sampler fault")
            return real_sample(self, logits, rows, need_logprobs)

        monkeypatch.setattr(Sampler, "sample", sample)
    else:
        real_plan = ParallelSampling.plan

        def plan(self, req, results):  # noqa: ANN001, ANN202
            if req.params.seed == VICTIM and len(req.group.seqs[0].output_token_ids) >= 3:
                raise RuntimeError("injected update fault")
            return real_plan(self, req, results)

        monkeypatch.setattr(ParallelSampling, "plan", plan)
    monkeypatch.setattr(engine, "async_scheduling", async_scheduling)
    outs, steps = generate_with_stats(engine, PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    victim = outs[1]
    assert victim.finished and victim.error_kind == "internal" and victim.outputs == []
    assert "injected" not in (victim.error or "")  # the fault's text is logged, never returned
    for i, out in enumerate(outs):
        if i != 1:
            assert out.error is None and out.outputs[0].token_ids == alone[i], f"request {i}"
    assert len(steps) >= 12  # the others ran on after the fault
    _idle_and_clean(engine)


def test_unusable_distribution_fails_its_request_alone(llm: LLM, alone: dict, monkeypatch) -> None:
    """A row whose distribution is unusable (every token banned, or NaN logits) ends its request with a
    clear error instead of a meaningless token."""
    engine = llm.engine
    real_process = Sampler.process

    def process(self, logits, rows):  # noqa: ANN001, ANN202
        out = real_process(self, logits, rows).float().clone()  # process may return the logits themselves
        for i, r in enumerate(rows):
            if r.params.seed == VICTIM:
                out[i] = float("nan") if r.generated % 2 else float("-inf")
        return out

    monkeypatch.setattr(Sampler, "process", process)
    outs = llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    assert outs[1].error_kind == "internal" and "no usable next-token distribution" in (outs[1].error or "")
    assert all(outs[i].outputs[0].token_ids == alone[i] for i in (0, 2, 3))
    _idle_and_clean(engine)


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(n=2, use_beam_search=True, temperature=0.0, length_penalty=1e308), "length_penalty"),
        (dict(n=2, use_beam_search=True, temperature=0.0, length_penalty=-1e308), "length_penalty"),
        (dict(n=2, use_beam_search=True, temperature=0.0, length_penalty=float("nan")), "length_penalty"),
        (dict(repetition_penalty=1e-300), "repetition_penalty"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
        (dict(stop=["x"] * 17), "stop"),
        (dict(stop=["x" * 257]), "stop"),
        (dict(stop_token_ids=[49152 + 5], min_tokens=2), "stop_token_ids"),  # out of the vocabulary
        (dict(n=64, logprobs=20, max_tokens=8000), "logprobs"),  # 64 x 8000 x 21 entries
    ],
)
def test_values_past_the_limits_are_refused_at_the_door(llm: LLM, kwargs: dict, param: str) -> None:
    with pytest.raises(RequestError) as err:
        llm.generate("Hello", SamplingParams(**kwargs))
    assert err.value.param == param
    _idle_and_clean(llm.engine)
    assert 64 * 8000 * 21 > MAX_LOGPROB_ENTRIES


def test_beam_search_with_many_stop_ids_stays_small(llm: LLM) -> None:
    """Beam search used to rank (1 + stop ids) x width candidates over the whole vocabulary: its memory grew
    with the product of two options. Now it ranks 2 x width of them, whatever the number of stop ids."""
    stop = list(range(40000, 40000 + MAX_STOP_TOKEN_IDS))  # rare tokens: not among the best continuations
    plain = SamplingParams(n=2, best_of=16, use_beam_search=True, temperature=0.0, max_tokens=6)
    wide = SamplingParams(**{**vars(plain), "stop_token_ids": stop})
    got = llm.generate("The capital of France is", wide)[0]
    want = llm.generate("The capital of France is", plain)[0]
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    _idle_and_clean(llm.engine)
