"""Structured outputs on the default model: every output follows its JSON schema (checked by `jsonschema`, an
independent validator), regex, choice list or grammar, greedy and sampled, n > 1 and beam search; the same
outputs under async scheduling and preemption; bad specs refused before anything is queued; compiles cached and
waited for outside the scheduler."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from pathlib import Path

import jsonschema
import pytest
import torch

from tinypaged import LLM, SamplingParams
from tinypaged.engine.request import EngineRequest
from tinypaged.engine.structured import bitmask_width
from tinypaged.errors import RequestError
from tinypaged.sampling_params import StructuredOutputsParams as Structured

# Bounded strings and arrays: each grammar's every path ends well within max_tokens, so every output completes.
SCHEMAS = [
    {  # nested objects, required and optional fields
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    {  # arrays with bounds, enums
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["colors", "size"],
        "additionalProperties": False,
    },
    {  # numbers with bounds
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "ok": {"type": "boolean"},
        },
        "required": ["age", "score", "ok"],
        "additionalProperties": False,
    },
    {  # $defs and references
        "$defs": {
            "item": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 8},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}},
        "required": ["items"],
        "additionalProperties": False,
    },
    {  # a top-level array of nullable values
        "type": "array",
        "items": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "null"}]},
        "minItems": 2,
        "maxItems": 3,
    },
]
PROMPT = "<|im_start|>user\nAnswer in JSON.<|im_end|>\n<|im_start|>assistant\n"


def _all_outputs(outs) -> list:  # noqa: ANN001
    return [o for out in outs for o in out.outputs]


def test_json_schemas_greedy_and_sampled(llm: LLM) -> None:
    """Every output of every schema parses and validates: greedy, and sampled with n = 3."""
    params = []
    for i, schema in enumerate(SCHEMAS):
        spec = Structured(json=schema)
        params.append(SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=spec))
        params.append(SamplingParams(temperature=1.0, seed=i, n=3, max_tokens=120, structured_outputs=spec))
    outs = llm.generate([PROMPT] * len(params), params)
    for out, sp in zip(outs, params, strict=True):
        assert sp.structured_outputs is not None
        assert len(out.outputs) == sp.n
        for o in out.outputs:
            assert o.finish_reason == "stop", o.text
            jsonschema.validate(json.loads(o.text), sp.structured_outputs.json)
    assert not llm.engine.has_unfinished_requests()


def test_regex_choice_grammars(llm: LLM) -> None:
    """Regex, choice (sampled, and by beam search), Lark and GBNF grammars, and any JSON object."""
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
    choices = ["yes", "no", "not sure"]
    lark = 'start: "(" num (" + " num)* ")"\nnum: /[1-9]/'
    gbnf = 'root ::= "The answer is " ("true" | "false") "."'
    cases = [
        (
            Structured(regex=date),
            SamplingParams(temperature=0.0, max_tokens=20),
            lambda t: re.fullmatch(date, t),
        ),
        (
            Structured(regex=date),
            SamplingParams(temperature=1.2, seed=5, n=3, max_tokens=20),
            lambda t: re.fullmatch(date, t),
        ),
        (
            Structured(choice=choices),
            SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=8),
            lambda t: t in choices,
        ),
        (
            Structured(choice=choices),
            SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=8),
            lambda t: t in choices,
        ),
        (
            Structured(grammar=lark),
            SamplingParams(temperature=0.0, max_tokens=30),
            lambda t: re.fullmatch(r"\([1-9]( \+ [1-9])*\)", t),
        ),
        (
            Structured(grammar=gbnf),
            SamplingParams(temperature=0.0, max_tokens=12),
            lambda t: t in ("The answer is true.", "The answer is false."),
        ),
        (
            Structured(json_object=True),
            SamplingParams(temperature=0.0, max_tokens=60),
            lambda t: isinstance(json.loads(t), dict),
        ),
    ]
    for spec, sp, _ in cases:
        sp.structured_outputs = spec
    outs = llm.generate([PROMPT] * len(cases), [sp for _, sp, _ in cases])
    for out, (_, sp, ok) in zip(outs, cases, strict=True):
        assert len(out.outputs) == sp.n
        for o in out.outputs:
            assert ok(o.text), (sp.structured_outputs, o.text, o.finish_reason)
    # A beam search's outputs are distinct choices.
    assert len({o.text for o in outs[3].outputs}) == 2


def test_unsatisfiable_within_max_tokens_ends_with_length(llm: LLM) -> None:
    """A grammar that needs more tokens than max_tokens allows ends at max_tokens, finish_reason "length"."""
    sp = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=Structured(regex="x{200}"))
    out = llm.generate(PROMPT, sp)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4 and set(out.text) == {"x"}


def test_unconstrained_steps_are_untouched(llm: LLM, generate_with_stats) -> None:
    """Steps with no constrained request do no mask work; a mixed batch masks only the constrained rows."""
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    _, steps = generate_with_stats(llm.engine, [PROMPT], [plain])
    assert all(s.num_constrained == 0 and s.mask_s == 0.0 for s in steps)
    spec = Structured(regex="[a-z]{10}")
    constrained = SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=spec)
    outs, steps = generate_with_stats(llm.engine, [PROMPT, PROMPT], [plain, constrained])
    assert max(s.num_constrained for s in steps) == 1 and max(s.num_draws for s in steps) == 2
    assert (
        outs[0].outputs[0].token_ids
        == generate_with_stats(llm.engine, [PROMPT], [plain])[0][0].outputs[0].token_ids
    )


def test_same_outputs_under_async_scheduling_and_preemption(llm: LLM, model_dir: Path) -> None:
    """Matchers follow their sequences through deferred steps (async scheduling) and preemption by recompute
    and by swap: the outputs are the synchronous, roomy engine's."""
    prompts = [PROMPT + "x" * (i % 7) for i in range(12)]
    params = [
        SamplingParams(
            temperature=0.0 if i % 3 == 0 else 0.9,
            seed=i,
            n=2 if i % 4 == 1 else 1,
            max_tokens=60,
            structured_outputs=Structured(json=SCHEMAS[i % len(SCHEMAS)]),
        )
        for i in range(len(prompts))
    ]
    want = [[o.text for o in out.outputs] for out in llm.generate(prompts, params)]
    for mode in ("recompute", "swap"):
        small = LLM(
            model=model_dir,
            seed=0,
            num_gpu_blocks_override=20,
            preemption_mode=mode,
            swap_space=0.5,
            async_scheduling=True,
        )
        got = [[o.text for o in out.outputs] for out in small.generate(prompts, params)]
        assert small.engine.scheduler.num_preemptions > 0
        assert got == want
        small.engine.check_integrity()
        small.shutdown()


@pytest.mark.parametrize(
    ("spec", "param"),
    [
        (dict(regex="a(b"), "structured_outputs.regex"),
        (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "structured_outputs.json"),
        (dict(json="{not json"), "structured_outputs.json"),
        (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
        (dict(grammar="root ::= ("), "structured_outputs.grammar"),
        (dict(choice=[]), "structured_outputs.choice"),
        (dict(regex="a", choice=["a"]), "structured_outputs"),
        (dict(), "structured_outputs"),
        (dict(regex="a" * 70000), "structured_outputs.regex"),
    ],
)
def test_bad_specs_refused_before_queueing(llm: LLM, spec: dict, param: str) -> None:
    with pytest.raises(RequestError) as e:
        llm.generate(PROMPT, SamplingParams(structured_outputs=spec))  # type: ignore[arg-type]
    assert e.value.param == param
    assert not llm.engine.has_unfinished_requests()


def test_compiled_once_and_waited_for_outside_the_scheduler(llm: LLM) -> None:
    """The same spec compiles once (one cached future); a request whose grammar is still compiling waits
    outside the scheduler, counted as waiting, while another request runs; it starts once compiled."""
    engine = llm.engine
    spec = Structured(regex="[0-9]{4}")
    assert engine.grammars.submit(spec) is engine.grammars.submit(Structured(regex="[0-9]{4}"))
    compiled = engine.grammars.compile(spec)
    slow: Future = Future()  # a compile that has not finished yet
    ids = engine.tokenizer.encode(PROMPT)
    sp = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=spec)
    engine.add(EngineRequest("slow", PROMPT, ids, sp, slow))
    engine.add_request("other", PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert engine.stats().num_waiting == 2
    finished = {}
    for _ in range(3):
        finished.update((o.request_id, o) for o in engine.step().outputs if o.finished)
        assert engine.scheduler.get_seq_group("slow") is None  # held back; "other" runs
    assert "other" in finished and engine.stats().num_waiting == 1
    slow.set_result(compiled)
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step().outputs if o.finished)
    assert re.fullmatch("[0-9]{4}", finished["slow"].outputs[0].text)
    # A compile that fails after the request was queued ends it with the reason (a 400 over HTTP).
    failed: Future = Future()
    engine.add(EngineRequest("bad", PROMPT, ids, sp, failed))
    failed.set_exception(RequestError("invalid regex", "structured_outputs.regex"))
    out = [o for o in engine.step().outputs if o.request_id == "bad"][0]
    assert out.finished and out.error_kind == "invalid" and out.error == "invalid regex"
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_masks_filled_in_parallel_equal_serial(llm: LLM) -> None:
    """A large batch's masks (llguidance's threads) are the ones each matcher gives alone."""
    grammars = llm.engine.grammars
    grammar = grammars.compile(Structured(json=SCHEMAS[0]))
    tok = grammars.tokenizer()
    prefixes = ['{"name": "', '{"name": "Al', '{"name": "Bo", "address": {"city": "X"', '{"na']
    matchers = []
    for i in range(40):
        m = grammar.matcher()
        assert m.consume_tokens(tok.tokenize_str(prefixes[i % len(prefixes)]))
        matchers.append(m)
    width = bitmask_width(grammars.vocab_size)
    together = torch.zeros((40, width), dtype=torch.int32)
    grammars.fill_bitmask(matchers, together)
    alone = torch.zeros((40, width), dtype=torch.int32)
    for i, m in enumerate(matchers):
        grammars.fill_bitmask([m], alone[i : i + 1])
    assert torch.equal(together, alone) and len({tuple(r.tolist()) for r in alone}) == len(prefixes)
