"""Structured outputs on the default model: every output follows its JSON schema (checked by `jsonschema`, an
independent validator), regex, choice list or grammar, greedy and sampled, n > 1 and beam search; the same
outputs under async scheduling and preemption; bad specs refused before anything is queued; compiles cached and
waited for outside the scheduler."""

from __future__ import annotations

import asyncio
import json
import random
import re
from concurrent.futures import Future
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
import uvloop
from llguidance import LLParserLimits

from tinypaged import LLM, SamplingParams
from tinypaged.config import EngineConfig
from tinypaged.engine.frontend.process_engine import ProcessEngine
from tinypaged.engine.request import EngineRequest
from tinypaged.engine.sampling import structured
from tinypaged.engine.sampling.structured import GrammarFailure, bitmask_width
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
    assert compiled is engine.grammars.compile(spec)  # shared, immutable
    slow.set_result(engine.grammars.start(spec).result(10))  # this request's own matcher
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
    start = grammars.start(Structured(json=SCHEMAS[0])).result(10)
    tok = grammars.tokenizer()
    prefixes = ['{"name": "', '{"name": "Al', '{"name": "Bo", "address": {"city": "X"', '{"na']
    matchers = []
    for i in range(40):
        m = start.deep_copy()
        assert m.consume_tokens(tok.tokenize_str(prefixes[i % len(prefixes)]))
        matchers.append(m)
    width = bitmask_width(grammars.vocab_size)
    together = torch.zeros((40, width), dtype=torch.int32)
    grammars.fill_bitmask(matchers, together)
    alone = torch.zeros((40, width), dtype=torch.int32)
    for i, m in enumerate(matchers):
        grammars.fill_bitmask([m], alone[i : i + 1])
    assert torch.equal(together, alone) and len({tuple(r.tolist()) for r in alone}) == len(prefixes)


def nested(depth: int, leaf: dict | None = None) -> dict:
    """`depth` arrays of arrays around `leaf`, built without recursion."""
    schema = leaf if leaf is not None else {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def _serves(llm: LLM) -> None:
    """The engine is alive and answers a plain request and a constrained one, with nothing left behind."""
    plain, constrained = llm.generate(
        [PROMPT, PROMPT],
        [
            SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
            SamplingParams(
                temperature=0.0, max_tokens=8, structured_outputs=Structured(choice=["yes", "no"])
            ),
        ],
    )
    assert len(plain.outputs[0].token_ids) == 2 and constrained.outputs[0].text in ("yes", "no")
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()


# Specs the probe of 2026-12-02 sent (each took the engine core down) and their kin: refused with a 400 naming the
# parameter, whichever check finds them (the spec check, llguidance's converters, the matcher, its first mask).
HOSTILE = [
    dict(json='{"type": "string", "maxLength": Infinity}'),
    dict(json='{"type": "integer", "minimum": 1e400}'),
    dict(json={"enum": [float("nan")]}),
    dict(json=nested(130)),
    dict(json=nested(100_000)),
    dict(json="[" * 60_000),
    dict(json='{"a": ' * 30_000 + "1" + "}" * 30_000),
    dict(json={"type": "string", "maxLength": 1e300}),
    dict(json={"type": "integer", "minimum": -(10**400)}),
    dict(json={"type": "integer", "minimum": -1e30, "maximum": 1e30}),
    dict(json={"type": "string", "pattern": "a(b"}),
    dict(json={"type": "string"}, whitespace_pattern="(("),
    dict(regex="(" * 300 + "a" + ")" * 300),
    dict(regex="[z-a]"),
    dict(grammar="start: " + "(" * 3000 + '"a"' + ")" * 3000),
    dict(grammar="root ::= " + "(" * 3000 + '"a"' + ")" * 3000),
]


@pytest.mark.parametrize("spec", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_specs_fail_alone(llm: LLM, spec: dict) -> None:
    """Each is a RequestError naming its field, nothing stays queued, and the engine serves the next request."""
    kind = next(k for k in ("json", "regex", "grammar") if k in spec)
    with pytest.raises(RequestError) as e:
        llm.generate(PROMPT, SamplingParams(max_tokens=2, structured_outputs=Structured(**spec)))
    assert e.value.param in (f"structured_outputs.{kind}", "structured_outputs.whitespace_pattern"), e.value
    _serves(llm)


class _Panic(BaseException):
    """What a panic inside llguidance raises (pyo3's PanicException is a BaseException)."""


@pytest.mark.parametrize(
    ("error", "refused"),
    [
        (ValueError("refused"), True),
        (RecursionError("too deep"), True),
        (MemoryError(), True),
        (KeyError("a bug"), False),
        (_Panic("a panic"), False),
    ],
)
def test_any_compile_failure_fails_its_request_alone(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, error: BaseException, refused: bool
) -> None:
    """Whatever preparing a grammar raises fails its request alone: a RequestError naming the field when the
    spec is at fault, else GrammarFailure, from the pool, never the caller's thread (LLM, the engine's step).
    A failure that may not repeat is not cached."""
    engine = llm.engine

    def failing(spec: Structured) -> str:
        raise error

    monkeypatch.setattr(structured, "grammar_source", failing)
    spec = Structured(regex=f"compile failure {type(error).__name__}")
    future = engine.grammars.submit(spec)  # returns at once, whatever the compile does
    with pytest.raises(RequestError if refused else GrammarFailure) as e:
        llm.generate(PROMPT, SamplingParams(max_tokens=2, structured_outputs=spec))
    if refused:
        assert e.value.param == "structured_outputs.regex"
    assert (engine.grammars.submit(spec) is future) == (refused and not isinstance(error, MemoryError))
    # A request queued while its compile runs, which then fails, ends at a step with the reason; the others go on.
    compiling: Future = Future()
    sp = SamplingParams(temperature=0.0, max_tokens=2, structured_outputs=spec)
    engine.add(EngineRequest("failed", PROMPT, engine.tokenizer.encode(PROMPT), sp, compiling))
    engine.add_request("other", PROMPT, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    outs = {o.request_id: o for o in engine.step().outputs if o.finished}
    compiling.set_exception(future.exception())
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step().outputs if o.finished)
    assert outs["failed"].error_kind == ("invalid" if refused else "internal") and not outs["failed"].outputs
    assert len(outs["other"].outputs[0].token_ids) == 2
    monkeypatch.undo()
    _serves(llm)


def test_exhausted_lexer_fails_its_request_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request builds its own matcher (llguidance's deep_copy shares a lexer, so copies of one cached
    start would share its lexer-state budget): a request that runs its lexer out fails with the reason (never
    "stop" with a partial output), the shared grammar stays as it was, and the next request with it, or one
    beside it, is not poisoned."""
    monkeypatch.setattr(
        structured, "PARSER_LIMITS", LLParserLimits(max_lexer_states=2000, verbose_errors=False)
    )
    regex = "(.*a.{200}c)"  # a DFA of 2^200 states: each step builds new ones
    spec = Structured(regex=regex)
    grammar = llm.engine.grammars.compile(spec)
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=16, structured_outputs=spec) for i in range(4)
    ]
    outs = llm.generate([PROMPT] * 4, params)
    failed = [o for o in outs if o.error is not None]
    assert failed, [o.outputs[0].finish_reason for o in outs]
    for o in failed:
        assert o.error_kind == "invalid" and not o.outputs, o
        assert "structured_outputs.regex" in o.error and "too many states" in o.error, o.error
    for o in outs:
        if o.error is None:
            assert o.outputs[0].finish_reason == "length", o.outputs[0]  # 202 characters at least
    assert llm.engine.grammars.compile(spec) is grammar  # immutable: nothing to evict
    # One request's matcher run out of lexer states leaves another's with the same spec as it was.
    grammars = llm.engine.grammars
    exhausted, beside = grammars.start(spec).result(10), grammars.start(spec).result(10)
    mask = np.zeros(bitmask_width(grammars.vocab_size), dtype=np.int32)
    rng = random.Random(0)
    for _ in range(200):  # random allowed tokens: new lexer states at every step, until its budget ends
        exhausted.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if exhausted.is_error():
            break
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        assert exhausted.consume_token(int(rng.choice(allowed)))
    assert exhausted.is_error() and "too many states" in exhausted.get_error()
    beside.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    assert not beside.is_error() and mask.any()
    again = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=2, structured_outputs=spec))[0]
    assert again.error is None and again.outputs[0].finish_reason == "length"
    assert len(again.outputs[0].token_ids) == 2 and again.outputs[0].text
    monkeypatch.undo()
    _serves(llm)


def test_core_process_survives_bad_grammars(model_dir: Path) -> None:
    """The engine-core process: specs refused by its compiler (sent without waiting for the compile, the path
    that killed it) end their requests with the reason; concurrent requests whose lexers run
    out of a limit each follow it or fail with the reason; the next request with it is not poisoned; the core
    serves on with every block free."""
    engine = ProcessEngine(EngineConfig(model=model_dir, seed=0))
    regex = "(.*[aeiou].{100}[a-z])"  # runs out of llguidance's lexer budget about 20 tokens in

    async def final(spec: Structured, max_tokens: int, rid: str, seed: int = 0):  # noqa: ANN202
        sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=spec)
        return [out async for out in engine.generate(PROMPT, sp, rid)][-1]

    async def main() -> None:
        await engine.start()
        try:
            bad = [
                Structured(json={"type": "string", "maxLength": 1e300}),
                Structured(json={"type": "integer", "minimum": -(10**400)}),
                Structured(json=nested(60, {"type": "string", "pattern": "a(b"})),
                Structured(regex="(" * 300 + "a" + ")" * 300),
            ]
            for i, spec in enumerate(bad):
                out = await final(spec, 2, f"bad{i}")
                assert out.finished and out.error_kind == "invalid" and not out.outputs, out
                with pytest.raises(RequestError) as e:
                    await engine.compile_grammar(SamplingParams(structured_outputs=spec))
                assert e.value.param == f"structured_outputs.{spec.kind}"
            spec = Structured(regex=regex)
            outs = await asyncio.gather(*(final(spec, 48, f"r{i}", seed=i) for i in range(4)))
            for o in outs:
                if o.error is not None:
                    assert o.error_kind == "invalid" and "structured_outputs.regex" in o.error, o.error
                else:
                    text = o.outputs[0].text
                    assert o.outputs[0].finish_reason == "length" or re.fullmatch(regex, text, re.S), text
            assert any(o.error is not None for o in outs)
            again = await final(spec, 3, "again")
            assert again.error is None and len(again.outputs[0].token_ids) == 3, again
            plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            out = [o async for o in engine.generate(PROMPT, plain, "plain")][-1]
            assert len(out.outputs[0].token_ids) == 2
            stats = engine.stats()
            assert stats.num_running == stats.num_waiting == 0
            await engine.check_integrity()
        finally:
            await engine.shutdown()

    uvloop.run(main())
