"""Hypothesis drives structured-output specs through the engine on the default model: JSON schemas of random
shape and nesting (arrays, objects, anyOf, $refs, past limits.MAX_SCHEMA_DEPTH too), keywords with bad values
(Infinity, NaN, numbers past any range, wrong types), bad and costly regexes and grammars. Each request either
runs (its output ends with a reason, or fails alone with the reason) or is refused with a RequestError naming
its field; nothing else escapes, nothing stays queued, and the engine serves a normal request afterwards."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tinypaged import LLM, SamplingParams
from tinypaged import limits as L
from tinypaged.errors import RequestError
from tinypaged.sampling_params import StructuredOutputsParams as Structured

PROMPT = "<|im_start|>user\nAnswer in JSON.<|im_end|>\n<|im_start|>assistant\n"

BAD_VALUES = [
    float("inf"),
    float("-inf"),
    float("nan"),
    10**400,
    -(10**400),
    1e300,
    -1,
    0,
    2**64,
    0.5,
    "x",
    None,
    True,
    [],
    {},
]
KEYWORDS = [
    "maxLength",
    "minLength",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "multipleOf",
    "minItems",
    "maxItems",
    "minProperties",
    "pattern",
    "format",
    "enum",
    "const",
    "type",
    "required",
    "additionalProperties",
    "$ref",
]
PATTERNS = [
    "a(b",
    "[z-a]",
    "(?<=a)b",
    "a{99999}",
    "\\",
    "(.*a.{50}c)",
    "^[0-9]{5}$",
    "\\p{Foo}",
    "(a|b)*c",
    "é+",
]
TYPES = ["string", "integer", "number", "boolean", "null", "object", "array", "strin"]

leaves = st.one_of(
    st.builds(lambda t: {"type": t}, st.sampled_from(TYPES)),
    st.builds(lambda k, v: {"type": "string", k: v}, st.sampled_from(KEYWORDS), st.sampled_from(BAD_VALUES)),
    st.builds(lambda k, v: {"type": "integer", k: v}, st.sampled_from(KEYWORDS), st.sampled_from(BAD_VALUES)),
    st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(PATTERNS)),
    st.builds(lambda v: {"enum": v}, st.lists(st.sampled_from(BAD_VALUES[5:11]), min_size=1, max_size=4)),
    st.just({}),
)


@st.composite
def schemas(draw: st.DrawFn) -> dict[str, Any]:
    """A leaf wrapped in `depth` random layers, mostly within the depth limit, sometimes past it."""
    depth = draw(
        st.one_of(st.integers(0, 12), st.integers(L.MAX_SCHEMA_DEPTH // 2 - 2, L.MAX_SCHEMA_DEPTH + 8))
    )
    schema = draw(leaves)
    for _ in range(depth):
        layer = draw(st.sampled_from(["array", "object", "anyOf", "ref", "tuple"]))
        if layer == "array":
            schema = {"type": "array", "items": schema, "maxItems": draw(st.sampled_from([1, 2, 10**400]))}
        elif layer == "object":
            schema = {
                "type": "object",
                "properties": {"a": schema},
                "required": draw(st.sampled_from([[], ["a"]])),
            }
        elif layer == "anyOf":
            schema = {"anyOf": [schema, draw(leaves)]}
        elif layer == "ref":
            schema = {"$defs": {"d": schema}, "$ref": draw(st.sampled_from(["#/$defs/d", "#/$defs/missing"]))}
        else:
            schema = {"type": "array", "prefixItems": [schema, draw(leaves)], "items": False}
    return schema


regexes = st.lists(
    st.sampled_from(["a", "(", ")", "[0-9]", "{2}", "{1000}", ".*", "|", "\\", "+", "?", "(?:", "x{3,1}"]),
    min_size=1,
    max_size=12,
).map("".join)
grammars = st.one_of(
    st.builds(lambda n: "start: " + "(" * n + '"a"' + ")" * n, st.integers(1, 4000)),
    st.builds(lambda r: f"start: /{r}/", regexes),
    st.builds(lambda n: "root ::= " + "(" * n + '"a"' + ")" * n, st.integers(1, 4000)),
    st.just("start: start"),
)
specs = st.one_of(
    st.builds(lambda s: {"json": s}, schemas()),
    st.builds(
        lambda s, ws: {"json": s, "whitespace_pattern": ws}, schemas(), st.sampled_from(["((", "[ ]*", " "])
    ),
    st.builds(lambda r: {"regex": r}, regexes),
    st.builds(lambda g: {"grammar": g}, grammars),
)


@settings(max_examples=30, deadline=None)
@given(spec=specs)
def test_any_spec_compiles_or_fails_alone(llm: LLM, spec: dict[str, Any]) -> None:
    kind = next(k for k in ("json", "regex", "grammar") if k in spec)
    fields = (f"structured_outputs.{kind}", "structured_outputs.whitespace_pattern")
    try:
        structured = Structured(**spec)
    except RequestError as e:  # the spec check: the engine never sees it
        assert e.param in fields, (e.param, str(e))
        return
    constrained = SamplingParams(temperature=0.0, max_tokens=2, structured_outputs=structured)
    plain = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # beside it, or after its refusal
    try:
        out, served = llm.generate([PROMPT, PROMPT], [constrained, plain])
    except RequestError as e:
        assert e.param in fields, (e.param, str(e))
        assert not llm.engine.has_unfinished_requests()
        served = llm.generate(PROMPT, plain)[0]
    else:
        if out.error is not None:  # ran past a limit of its grammar while generating: failed alone, with why
            assert out.error_kind == "invalid" and f"structured_outputs.{kind}" in out.error, out
        else:
            assert out.outputs[0].finish_reason in ("stop", "length"), out
    assert served.error is None and len(served.outputs[0].token_ids) == 1
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
