"""Structured outputs and tool calls over HTTP, with the official `openai` client against the real server:
`response_format` (json_object, json_schema), vLLM's `structured_outputs`, `chat.completions.parse` with a
pydantic model, tools with every `tool_choice`, streamed deltas reassembled, bad specs as 400s naming the
parameter, and a tool call's round trip."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _chat_stream(stream) -> tuple[str, dict[int, dict], str | None]:  # noqa: ANN001
    """A streamed chat choice reassembled: its content, its tool calls by index, its finish reason."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                call = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or t.id
                call["name"] += t.function.name or ""
                call["arguments"] += t.function.arguments or ""
            reason = c.finish_reason or reason
    return content, calls, reason


def test_response_format_json_schema_plain_and_streamed(client: openai.OpenAI, server) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kwargs = dict(model=server.model, messages=ASK, max_tokens=60, temperature=0, response_format=fmt)
    plain = client.chat.completions.create(**kwargs)
    text = plain.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert plain.choices[0].finish_reason == "stop"
    content, calls, reason = _chat_stream(client.chat.completions.create(stream=True, **kwargs))
    assert (content, calls, reason) == (text, {}, "stop")
    sampled = client.chat.completions.create(**(kwargs | dict(temperature=1.0, seed=3, n=3)))
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_and_vllm_extras_on_both_endpoints(client: openai.OpenAI, server) -> None:
    obj = client.chat.completions.create(
        model=server.model,
        messages=ASK,
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].finish_reason != "stop" or isinstance(
        json.loads(obj.choices[0].message.content), dict
    )
    choice = client.chat.completions.create(
        model=server.model,
        messages=ASK,
        max_tokens=8,
        temperature=0.7,
        seed=1,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}},
    )
    assert choice.choices[0].message.content in ("sunny", "rainy")
    regex = r"[A-Z][a-z]{2,8} [0-9]{1,2}"
    plain = client.completions.create(
        model=server.model,
        prompt="Date:",
        max_tokens=12,
        temperature=0,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert re.fullmatch(regex, plain.choices[0].text)
    streamed = client.completions.create(
        model=server.model,
        prompt="Date:",
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain.choices[0].text
    gbnf = client.completions.create(
        model=server.model,
        prompt="Is the sky blue?",
        max_tokens=6,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
    )
    assert gbnf.choices[0].text in ("yes", "no")


class Step(pydantic.BaseModel):
    explanation: str = pydantic.Field(max_length=30)
    output: int


class Solution(pydantic.BaseModel):
    steps: list[Step] = pydantic.Field(max_length=2)
    final_answer: int


def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI, server) -> None:
    """The client sends the model's strict JSON schema ($defs, refs) and parses the reply into the model."""
    parse = client.chat.completions.parse if hasattr(client.chat.completions, "parse") else None
    parse = parse or client.beta.chat.completions.parse
    done = parse(
        model=server.model,
        messages=[{"role": "user", "content": "Solve 2 + 3 step by step."}],
        response_format=Solution,
        max_tokens=120,
        temperature=0,
    )
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Solution) and done.choices[0].finish_reason == "stop"


def test_named_tool_choice_plain_streamed_and_round_trip(client: openai.OpenAI, server) -> None:
    kwargs = dict(
        model=server.model,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    )
    plain = client.chat.completions.create(**kwargs)
    message = plain.choices[0].message
    (call,) = message.tool_calls
    assert message.content is None and call.function.name == "get_weather" and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    content, calls, reason = _chat_stream(client.chat.completions.create(stream=True, **kwargs))
    assert content == "" and reason == plain.choices[0].finish_reason
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]
    # The call and the tool's answer go back into the conversation.
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    reply = client.chat.completions.create(
        model=server.model, messages=history, tools=[WEATHER], max_tokens=8
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_required_tool_choice_calls_valid_functions(client: openai.OpenAI, server) -> None:
    kwargs = dict(
        model=server.model,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    plain = client.chat.completions.create(**kwargs)
    choice = plain.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    content, calls, reason = _chat_stream(client.chat.completions.create(stream=True, **kwargs))
    assert reason == "tool_calls" and not content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    one = client.chat.completions.create(**(kwargs | dict(parallel_tool_calls=False)))
    assert len(one.choices[0].message.tool_calls) == 1


def test_auto_and_none_tool_choice(client: openai.OpenAI, server) -> None:
    """The default model writes no calls of its own; its text is the content, plain and streamed alike."""
    for choice in ("auto", "none"):
        kwargs = dict(
            model=server.model,
            messages=ASK,
            tools=[WEATHER],
            tool_choice=choice,
            max_tokens=12,
            temperature=0,
        )
        plain = client.chat.completions.create(**kwargs).choices[0]
        content, calls, reason = _chat_stream(client.chat.completions.create(stream=True, **kwargs))
        assert (content, reason) == (plain.message.content, plain.finish_reason)
        assert not plain.message.tool_calls and not calls


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),  # not supported
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wrong"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wrong"}}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tools[0].function.parameters",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
        ),
    ],
)
def test_bad_specs_are_400s_naming_the_parameter(raw, server, body: dict, param: str) -> None:
    status, _, data = raw("POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 4} | body)
    assert status == 400, data
    assert json.loads(data)["error"]["param"] == param
    assert server.engine.stats().num_waiting == 0
