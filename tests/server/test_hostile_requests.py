"""Client errors that used to be 500s, on the real server: each is a 4xx naming the parameter, logs no
traceback, and leaves the server serving. JSON nesting is bounded (limits.MAX_JSON_DEPTH) wherever the server
parses JSON: the body, tool-call arguments, a schema given as text; tool schemas are held to the limits of a
`response_format` schema."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinypaged.limits import MAX_GRAMMAR_CHARS, MAX_JSON_DEPTH

C, CHAT, TOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize"
USER = [{"role": "user", "content": "hi"}]


def nested_arrays(depth: int) -> str:
    return "[" * depth + "]" * depth


def array_schema(levels: int) -> str:
    """A JSON schema of `levels` nested arrays (one JSON level each), as text (too deep for json.dumps)."""
    return '{"type": "array", "items": ' * levels + '{"type": "string"}' + "}" * levels


DEEP = "@deep@"  # where a body's deep JSON text goes


def encode(body: dict, deep: str = "null") -> bytes:
    """The body as JSON, with the JSON text `deep` in place of the string DEEP."""
    return json.dumps(body).replace(json.dumps(DEEP), deep).encode()


def tool(params: dict | None, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def calls_message(arguments: str) -> dict:
    return {
        "role": "assistant",
        "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": arguments}}],
    }


BIG_PARAMS = {  # over MAX_GRAMMAR_CHARS as JSON text
    "type": "object",
    "properties": {
        f"p{i}": {"type": "string", "description": "x" * 100} for i in range(MAX_GRAMMAR_CHARS // 100)
    },
}
RF_DEEP = {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}
NAMED = {"type": "function", "function": {"name": "f"}}
ARGS = "messages[1].tool_calls[0].function.arguments"
SCHEMA = "response_format.json_schema.schema"

# (case, path, body, status, param, code)
CASES = [
    (
        "required-tool-schema-over-size",
        CHAT,
        {"messages": USER, "tools": [tool(None, "a"), tool(BIG_PARAMS)], "tool_choice": "required"},
        400,
        "tools[1].function.parameters",
        None,
    ),
    (
        "named-tool-schema-over-size",
        CHAT,
        {"messages": USER, "tools": [tool(BIG_PARAMS)], "tool_choice": NAMED},
        400,
        "tools[0].function.parameters",
        None,
    ),
    (
        "auto-tool-schema-over-size",
        CHAT,
        {"messages": USER, "tools": [tool(BIG_PARAMS)]},
        400,
        "tools[0].function.parameters",
        None,
    ),
    (
        "required-tools-together-over-size",  # each under the limit, the constraint over them all past it
        CHAT,
        {
            "messages": USER,
            "tools": [
                tool({"type": "object", "description": "x" * (MAX_GRAMMAR_CHARS // 3)}, f"f{i}")
                for i in range(4)
            ],
            "tool_choice": "required",
        },
        400,
        "tools",
        None,
    ),
    (
        "tool-call-arguments-100k-deep",
        CHAT,
        {"messages": [*USER, calls_message(nested_arrays(100_000))]},
        400,
        ARGS,
        "json_too_deep",
    ),
    (
        "tokenize-tool-call-arguments-100k-deep",
        TOKENIZE,
        {"messages": [*USER, calls_message(nested_arrays(100_000))]},
        400,
        ARGS,
        "json_too_deep",
    ),
    (
        "tool-call-arguments-past-the-limit",
        CHAT,
        {"messages": [*USER, calls_message(json.dumps({"a": json.loads(nested_arrays(MAX_JSON_DEPTH))}))]},
        400,
        ARGS,
        "json_too_deep",
    ),
    (
        "json-schema-975-levels",
        CHAT,
        ({"messages": USER, "response_format": RF_DEEP}, array_schema(975)),
        400,
        SCHEMA,
        "json_too_deep",
    ),
    (
        "completions-json-schema-deep",
        C,
        ({"prompt": "hi", "response_format": RF_DEEP}, array_schema(200)),
        400,
        SCHEMA,
        "json_too_deep",
    ),
    (
        "named-tool-schema-deep",
        CHAT,
        ({"messages": USER, "tools": [tool(DEEP)], "tool_choice": NAMED}, array_schema(400)),
        400,
        "tools[0].function.parameters",
        "json_too_deep",
    ),
    (
        "auto-tool-schema-deep",
        CHAT,
        ({"messages": USER, "tools": [tool(DEEP)]}, array_schema(5000)),
        400,
        "tools[0].function.parameters",
        "json_too_deep",
    ),
    (
        "structured-outputs-json-text-deep",
        C,
        {"prompt": "hi", "structured_outputs": {"json": '{"a":' * 5000 + "1" + "}" * 5000}},
        400,
        "structured_outputs.json",
        "json_too_deep",
    ),
    (
        "structured-outputs-json-deep",
        C,
        ({"prompt": "hi", "structured_outputs": {"json": DEEP}}, array_schema(300)),
        400,
        "structured_outputs.json",
        "json_too_deep",
    ),
    (
        "structured-outputs-json-text-infinity",  # parsed as strictly as the body: no engine sees Infinity
        C,
        {"prompt": "hi", "structured_outputs": {"json": '{"type": "string", "maxLength": Infinity}'}},
        400,
        "structured_outputs.json",
        None,
    ),
    (
        "unknown-field-deep",
        C,
        {"prompt": "hi", "extra": json.loads(nested_arrays(500))},
        400,
        "extra",
        "json_too_deep",
    ),
    (
        "prompt-deep",
        C,
        {"prompt": [[1, 2], json.loads(nested_arrays(200))]},
        400,
        "prompt[1][0]",
        "json_too_deep",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_client_errors_are_4xx_naming_the_parameter(raw, caplog, path, body, status, param, code) -> None:
    body, deep = body if isinstance(body, tuple) else (body, "null")
    body = {"max_tokens": 1, **body} if path != TOKENIZE else body
    with caplog.at_level(logging.INFO):
        got, headers, data = raw("POST", path, encode(body, deep), {"Content-Type": "application/json"})
    assert got == status, data[:300]
    error = json.loads(data)["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error"), error
    if code is not None:
        assert error["code"] == code and str(MAX_JSON_DEPTH) in error["message"], error
    assert len(data) < 2000  # the message quotes no more than a prefix of what was sent
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]


def test_within_the_limits_is_served(raw) -> None:
    """The limits leave room for real use: arguments and schemas tens of levels deep."""
    arguments = json.dumps({"a": json.loads(nested_arrays(MAX_JSON_DEPTH - 2))})  # 1 + 126 levels
    status, _, data = raw("POST", TOKENIZE, {"messages": [*USER, calls_message(arguments)]})
    assert status == 200, data
    schema = {"type": "object", "properties": {"a": json.loads(array_schema(20))}}
    for body in (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
        {"tools": [tool(schema)], "tool_choice": NAMED},
        {"tools": [tool(schema)], "tool_choice": "required"},
    ):
        status, _, data = raw("POST", CHAT, {"messages": USER, "max_tokens": 2, **body})
        assert status == 200, data


@pytest.mark.parametrize(
    "header",
    [
        b"Bearer \xff\xfe",
        b"Bearer \xed\xa0\x80",
        b"\xff\xfe test-key",
        b"Bearer test-key\xff",
        "Bearer ключ".encode(),
    ],
)
def test_authorization_headers_that_are_not_utf8_get_401(server, exchange, caplog, header: bytes) -> None:
    answer = exchange(
        server.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: " + header + b"\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_api_key"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]


@st.composite
def deep_requests(draw: st.DrawFn) -> tuple[str, bytes, str, int]:
    """A request with a value `depth` levels deep (counted from the body's top, or from the top of a JSON
    string the server parses) in one of the places a client can nest JSON freely: the path, the body, the
    parameter a too-deep error must name, and the depth. Built as text: hypothesis prints what it drew."""
    depth = draw(st.integers(min_value=MAX_JSON_DEPTH - 8, max_value=3000))
    place = draw(st.sampled_from(["schema", "tool", "arguments", "so-text", "extra"]))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"k": ', "}"), ('[1, "]}", ', "]")]))
    inner = draw(st.sampled_from(['"]}"', "1", '"\\\\\\"[{"', "[]", "{}"]))

    def value(levels: int) -> str:  # `levels` containers (an inner [] or {} is one of them)
        if inner in ("[]", "{}"):
            return opener * (levels - 1) + inner + closer * (levels - 1) if levels > 0 else "1"
        return opener * levels + inner + closer * levels

    if place == "schema":  # body, response_format, json_schema, schema: 4 levels
        body = encode({"messages": USER, "max_tokens": 1, "response_format": RF_DEEP}, value(depth - 3))
        return CHAT, body, SCHEMA, depth
    if place == "tool":  # body, tools, tools[0], function, parameters: 5 levels
        body = encode({"messages": USER, "max_tokens": 1, "tools": [tool(DEEP)]}, value(depth - 4))
        return CHAT, body, "tools[0].function.parameters", depth
    if place == "arguments":  # parsed on its own: counted from the arguments' top
        arguments = '{"a": ' + value(depth - 1) + "}"
        return TOKENIZE, encode({"messages": [*USER, calls_message(arguments)]}), ARGS, depth
    if place == "so-text":
        so = {"json": '{"a": ' + value(depth - 1) + "}"}
        return (
            C,
            encode({"prompt": "hi", "max_tokens": 1, "structured_outputs": so}),
            "structured_outputs.json",
            depth,
        )
    return C, encode({"prompt": "hi", "max_tokens": 1, "extra": DEEP}, value(depth - 1)), "extra", depth


@given(deep_requests())
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_nesting_anywhere_is_bounded(raw, request_case) -> None:
    """Whatever is nested where: past MAX_JSON_DEPTH a 400 naming the parameter, never a 5xx."""
    path, body, param, depth = request_case
    status, _, data = raw("POST", path, body, {"Content-Type": "application/json"})
    assert status < 500, data[:300]
    error = json.loads(data).get("error") if status != 200 else None
    if depth > MAX_JSON_DEPTH:
        assert status == 400 and (error["param"], error["code"]) == (param, "json_too_deep"), (depth, error)
    else:
        assert error is None or error["code"] != "json_too_deep", (depth, error)


@pytest.mark.parametrize(
    ("fault", "status"), [(RecursionError, 400), (MemoryError, 500), (KeyError, 500)], ids=lambda x: str(x)
)
def test_a_template_failure_fails_its_request_alone(raw, server, monkeypatch, fault, status) -> None:
    """A chat template that recurses past Python's stack on a client's values is that client's 400; any other
    failure while rendering is a 500 for that request alone (logged with an id), and the server goes on."""
    tok = server.serving.tokenizer
    real = tok.apply_chat_template

    def render(messages, **kwargs):  # noqa: ANN001, ANN003, ANN202
        if messages[-1]["content"] == "break me":
            raise fault("injected")
        return real(messages, **kwargs)

    monkeypatch.setattr(tok, "apply_chat_template", render)
    for path in (CHAT, TOKENIZE):
        body = {"messages": [{"role": "user", "content": "break me"}]}
        got, _, data = raw("POST", path, {**body, "max_tokens": 1} if path == CHAT else body)
        error = json.loads(data)["error"]
        assert got == status, data
        assert "injected" not in error["message"]
        assert error["param"] == ("messages" if status == 400 else None), error
        assert raw("POST", path, {"messages": USER, **({"max_tokens": 1} if path == CHAT else {})})[0] == 200
