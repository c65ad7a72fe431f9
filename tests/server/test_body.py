"""server/body.py's JSON nesting scan against an independent reference: the depth of the value itself."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tinypaged.server import protocol as p
from tinypaged.server.body import deep_offset, param_of

TRICKY_TEXT = st.text(alphabet='[]{}"\\ax,:', max_size=12)  # brackets, quotes and backslashes inside strings
VALUES = st.recursive(
    st.none() | st.integers() | TRICKY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY_TEXT, inner, max_size=3),
    max_leaves=40,
)


def depth(value: object) -> int:
    """Containers nested in a value (a scalar: 0)."""
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


def first_too_deep(text: str, limit: int) -> int | None:
    """The reference scan, a character at a time: the offset of the first container past `limit`."""
    level, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            level += 1
            if level > limit:
                return i
        elif ch in "]}":
            level -= 1
    return None


@given(VALUES, st.integers(min_value=0, max_value=6), st.booleans())
@settings(max_examples=300, deadline=None)
def test_deep_offset_finds_what_is_too_deep(value: object, limit: int, compact: bool) -> None:
    text = json.dumps(value, separators=(",", ":") if compact else None)  # ASCII: offsets are characters
    offset = deep_offset(text.encode(), limit)
    assert (offset is None) == (depth(value) <= limit)
    assert offset == first_too_deep(text, limit)


def test_param_of_follows_the_schema() -> None:
    assert param_of(p.ChatCompletionRequest, ["tools", 3, "function", "parameters", "a", 0]) == (
        "tools[3].function.parameters"
    )
    assert param_of(p.ChatCompletionRequest, ["response_format", "json_schema", "schema", "items"]) == (
        "response_format.json_schema.schema"
    )
    assert (
        param_of(p.ChatCompletionRequest, ["messages", 0, "content", 0, "text"])
        == "messages[0].content[0].text"
    )
    assert param_of(p.CompletionRequest, ["unknown", 1, 2]) == "unknown"
    assert param_of(p.CompletionRequest, ["prompt", 0, 0, 0]) == "prompt[0][0]"  # a token id where a list is
    assert param_of(p.CompletionRequest, [0]) is None
