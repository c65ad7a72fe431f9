"""Hypothesis drives sampling parameters from the whole range the HTTP schema accepts (and a little past it)
through the engine on the CPU, several requests in one batch: each request is either refused at the door
(RequestError naming a parameter) or served to its end; no step ever fails and every block comes back."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import fields

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinypaged import LLM, SamplingParams
from tinypaged import limits as L
from tinypaged.errors import RequestError
from tinypaged.sampling_params import StructuredOutputsParams

VOCAB = 49152  # the default model's
WORDS = "the a river blue seven engine paged block copy token , . ! \n é 漢 <|im_end|>".split(" ")

floats = st.floats(allow_nan=False, allow_infinity=False)
params = st.fixed_dictionaries(
    {},
    optional={
        "n": st.integers(1, 4),
        "best_of": st.integers(1, 5),
        "temperature": st.one_of(st.floats(0.0, 2.0), st.just(1.2e-5)),
        "top_p": st.floats(1e-6, 1.0),
        "top_k": st.one_of(st.integers(-1, 60), st.just(10**6)),
        "min_p": st.floats(0.0, 1.0),
        "presence_penalty": st.floats(*L.PENALTY),
        "frequency_penalty": st.floats(*L.PENALTY),
        "repetition_penalty": st.floats(*L.REPETITION_PENALTY),
        "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
        "max_tokens": st.integers(1, 8),
        "min_tokens": st.integers(0, 8),
        "stop": st.lists(st.text(st.sampled_from("ab .\né"), min_size=1, max_size=4), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, VOCAB + 3), max_size=4),
        "include_stop_str_in_output": st.booleans(),
        "ignore_eos": st.booleans(),
        "logprobs": st.one_of(st.none(), st.integers(0, L.MAX_LOGPROBS)),
        "prompt_logprobs": st.one_of(st.none(), st.integers(0, 3)),
        "skip_special_tokens": st.booleans(),
        "use_beam_search": st.booleans(),
        "length_penalty": st.floats(*L.LENGTH_PENALTY),
        "early_stopping": st.sampled_from([True, False, "never"]),
    },
)


@st.composite
def sampling(draw: st.DrawFn) -> dict:
    """Mostly valid combinations (greedy, sampled, beam search), some drawn freely to be refused."""
    kwargs = dict(draw(params))
    mode = draw(st.sampled_from(["greedy", "sample", "beam", "free"]))
    if mode == "free":
        return kwargs
    for beam_only in ("use_beam_search", "length_penalty", "early_stopping"):
        kwargs.pop(beam_only, None)
    if mode == "beam":
        for unused in ("top_p", "top_k", "min_p", "stop"):
            kwargs.pop(unused, None)
        kwargs.update(use_beam_search=True, temperature=0.0)
        kwargs["length_penalty"] = draw(st.floats(*L.LENGTH_PENALTY))
        kwargs["early_stopping"] = draw(st.sampled_from([True, False, "never"]))
        kwargs["best_of"] = max(2, kwargs.get("n", 1), kwargs.get("best_of", 2))
    else:
        kwargs["temperature"] = 0.0 if mode == "greedy" else draw(st.floats(0.05, 2.0))
        kwargs["best_of"] = max(kwargs.get("n", 1), kwargs.get("best_of", 1))
    kwargs["min_tokens"] = min(kwargs.get("min_tokens", 0), kwargs.get("max_tokens", 16))
    return kwargs


prompts = st.one_of(
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=30).map(" ".join),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40).map(lambda ids: {"prompt_token_ids": ids}),
)
SEEN: Counter[str] = Counter()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(st.tuples(prompts, sampling()), min_size=1, max_size=3))
def test_any_schema_value_is_served_or_refused(llm: LLM, batch: list) -> None:
    engine = llm.engine
    requests = []
    for i, (prompt, kwargs) in enumerate(batch):
        try:
            requests.append(engine.process_inputs(f"fuzz-{i}", prompt, SamplingParams(**kwargs)))
        except RequestError as e:
            assert e.param is not None, str(e)  # every refusal names its parameter
            SEEN[f"refused: {e.param}"] += 1
    for request in requests:
        engine.add(request)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:  # a StepError here fails the test
            if out.finished:
                finals[out.request_id] = out
    for request in requests:
        out = finals[request.request_id]
        assert out.error is None, out.error
        p = request.params
        assert len(out.outputs) == p.n
        assert all(o.finish_reason in ("stop", "length") for o in out.outputs)
        assert all(len(o.token_ids) <= (p.max_tokens or 10**9) for o in out.outputs)
        SEEN["beam search" if p.use_beam_search else f"served, n={p.n}"] += 1
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    print(f"\nparameter fuzz: {dict(sorted(SEEN.items()))}")


# Each field's types as HTTP's schema has them (the constructor's: stop also a str, None for the lists, a dict
# for structured_outputs): any value of another kind is a RequestError naming the field, before any check
# compares it.
NUMBER = {"int", "float"}
ACCEPTS: dict[str, set[str]] = {
    **dict.fromkeys(["n", "top_k", "min_tokens"], {"int"}),
    **dict.fromkeys(["best_of", "seed", "max_tokens", "logprobs", "prompt_logprobs"], {"int", "none"}),
    **dict.fromkeys(["include_stop_str_in_output", "ignore_eos", "skip_special_tokens"], {"bool"}),
    **dict.fromkeys(["temperature", "top_p", "min_p", "repetition_penalty", "length_penalty"], NUMBER),
    **dict.fromkeys(["presence_penalty", "frequency_penalty"], NUMBER),
    "stop": {"str", "list[str]", "none"},
    "stop_token_ids": {"list[int]", "none"},
    "use_beam_search": {"bool"},
    "early_stopping": {"bool", "never"},
    "structured_outputs": {"none", "dict"},
    "output_kind": set(),
}
STRUCTURED_ACCEPTS: dict[str, set[str]] = {
    **dict.fromkeys(["regex", "grammar", "whitespace_pattern"], {"str", "none"}),
    "json": {"dict", "str", "none"},
    "choice": {"list[str]", "none"},
    "json_object": {"bool", "none"},
    "disable_any_whitespace": {"bool"},
}
KINDS = {
    "int": st.integers(-(2**70), 2**70),
    "float": st.floats(),
    "bool": st.booleans(),
    "none": st.none(),
    "str": st.text(max_size=4).filter(lambda s: s != "never"),
    "list[str]": st.lists(st.text(max_size=3), min_size=1, max_size=3),
    "list[int]": st.lists(st.integers(0, 99), min_size=1, max_size=3),
    "list": st.lists(
        st.one_of(st.floats(), st.booleans(), st.none(), st.builds(object)), min_size=1, max_size=3
    ),
    "dict": st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    "object": st.builds(object),
}


def test_every_field_has_its_types() -> None:
    assert set(ACCEPTS) == {f.name for f in fields(SamplingParams)}
    assert set(STRUCTURED_ACCEPTS) == {f.name for f in fields(StructuredOutputsParams)}


@st.composite
def wrong_type(draw: st.DrawFn) -> tuple[str, object, dict]:
    """A field, a value of a kind it does not take, and the constructor's arguments that give it that value."""
    nested = draw(st.booleans())
    name = draw(st.sampled_from(sorted(STRUCTURED_ACCEPTS if nested else ACCEPTS)))
    accepted = (STRUCTURED_ACCEPTS if nested else ACCEPTS)[name]
    value = draw(st.sampled_from([k for k in KINDS if k not in accepted]).flatmap(KINDS.__getitem__))
    if not nested:
        return name, value, {name: value}
    other = {"choice": ["a"]} if name == "regex" else {"regex": "a"}  # a valid constraint beside it
    return f"structured_outputs.{name}", value, {"structured_outputs": {**other, name: value}}


@settings(max_examples=200, deadline=None)
@given(case=wrong_type(), after=st.booleans())
def test_a_wrong_type_is_refused_by_name(case: tuple[str, object, dict], after: bool) -> None:
    param, value, kwargs = case
    with pytest.raises(RequestError) as e:
        if after and "." not in param:  # set on a valid SamplingParams, then verify() (vLLM's habit)
            params = SamplingParams()
            setattr(params, param, value)
            params.verify()
        else:
            SamplingParams(**kwargs)
    assert e.value.param == param, (str(e.value), value)


@pytest.mark.parametrize(
    ("kwargs", "param"), [(dict(n="a", best_of=2), "n"), (dict(min_tokens="x", max_tokens=5), "min_tokens")]
)
def test_wrong_types_before_comparisons(kwargs: dict, param: str) -> None:
    with pytest.raises(RequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
