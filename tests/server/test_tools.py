"""Tool calls found in generated text (server/tools.py): Hermes blocks, Llama 3.x JSON and Mistral's
`[TOOL_CALLS]` for `auto`, the constrained array of `required`; fed whole or piece by piece (as a stream), the
same calls and content; and a chat template that reads `tools` gets them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tinypaged.server.tools import CallParser
from tinypaged.tokenizer import Tokenizer

HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
)
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
REQUIRED = (
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
    '{"name": "get_time", "parameters": {"zone": "UTC"}}]'
)


def _parse(mode: str, text: str, piece: int) -> tuple[str, list[tuple[str, dict]], list[int]]:
    """Content and (name, arguments) of the calls, fed `piece` characters at a time; and after how many
    characters each call came out."""
    parser, content, calls, when = CallParser(mode), "", [], []
    for i in range(0, len(text), piece):
        more, found = parser.feed(text[i : i + piece])
        content += more
        calls += found
        when += [i + piece] * len(found)
    more, found = parser.finish()
    content += more
    calls += found
    when += [len(text)] * len(found)
    return content, [(c.name, json.loads(c.arguments)) for c in calls], when


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_hermes_blocks(piece: int) -> None:
    content, calls, when = _parse("auto", HERMES, piece)
    assert content == "Let me check. "
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert piece >= len(HERMES) or when[0] < len(HERMES)  # sent once its block closes, not at the end


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_llama_json_calls(piece: int) -> None:
    content, calls, _ = _parse("auto", "  " + LLAMA, piece)
    assert content == "" and calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("piece", [1, 7, 1000])
def test_required_array(piece: int) -> None:
    content, calls, when = _parse("required", REQUIRED, piece)
    assert content == "" and calls == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    assert piece >= len(REQUIRED) or when[0] < len(REQUIRED)


MISTRAL_ARRAY = (
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
)
MISTRAL = {
    "v3": "[TOOL_CALLS] " + MISTRAL_ARRAY,
    "v3 marker skipped": MISTRAL_ARRAY,
    "v11": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
}


@pytest.mark.parametrize("form", list(MISTRAL))
@pytest.mark.parametrize("piece", [1, 6, 1000])
def test_mistral_calls(form: str, piece: int) -> None:
    content, calls, _ = _parse("auto", MISTRAL[form], piece)
    assert content == "" and calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize(
    "text",
    [
        "Plain text, no calls < at all.",
        "A <tool_ mention that never becomes a block",
        '{"not": "a call"}',
        "<tool_call>not json</tool_call> after",
        "[1] a list item, not a call",
        "[TOOL_CALLS]get_weather[ARGS]not json",
        '[{"not": "a call"}]',
    ],
)
@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_text_that_is_not_a_call_is_content(text: str, piece: int) -> None:
    content, calls, _ = _parse("auto", text, piece)
    assert calls == [] and content == text


def test_template_gets_the_tools(tmp_path: Path, model_dir: Path) -> None:
    """A template that reads `tools` renders them (as HF passes them); one that does not, as before."""
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    template = (
        "{% if tools %}Tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = Tokenizer(tmp_path)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tools=tools) == "Tools: get_weather user: hi\n"  # (trim_blocks)
    assert tok.apply_chat_template(messages) == "user: hi\n"
