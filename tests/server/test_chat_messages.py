"""Chat messages as OpenAI's schema has them: each role's required fields, content as a string or a non-empty
list of parts; anything else is a 400 naming the parameter. Accepted messages of every role reach the chat
template with their role, their text and their tool fields."""

from __future__ import annotations

import json

import pytest

CHAT = "/v1/chat/completions"
USER = {"role": "user", "content": "What is 2 + 2?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}

# (case, messages, the param the 400 names)
BAD = [
    ("role-missing", [{"content": "hi"}], "messages[0].role"),
    ("role-unknown", [{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ("role-not-a-string", [{"role": 3, "content": "hi"}], "messages[0].role"),
    ("system-without-content", [{"role": "system"}, USER], "messages[0].content"),
    ("system-content-null", [{"role": "system", "content": None}, USER], "messages[0].content"),
    ("developer-without-content", [{"role": "developer", "name": "x"}, USER], "messages[0].content"),
    ("user-without-content", [{"role": "user"}], "messages[0].content"),
    ("user-content-null", [{"role": "user", "content": None}], "messages[0].content"),
    ("user-content-number", [{"role": "user", "content": 5}], "messages[0].content"),
    ("user-content-empty-list", [{"role": "user", "content": []}], "messages[0].content"),
    ("user-content-list-of-strings", [{"role": "user", "content": ["hi"]}], "messages[0].content[0]"),
    ("part-without-type", [{"role": "user", "content": [{"text": "hi"}]}], "messages[0].content[0].type"),
    ("part-unknown-type", [{"role": "user", "content": [{"type": "video"}]}], "messages[0].content[0].type"),
    (
        "text-part-without-text",
        [{"role": "user", "content": [{"type": "text"}]}],
        "messages[0].content[0].text",
    ),
    (
        "text-part-text-not-a-string",
        [{"role": "user", "content": [{"type": "text", "text": 1}]}],
        "messages[0].content[0].text",
    ),
    (
        "image-part-not-served",
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "see"},
                    {"type": "image_url", "image_url": {"url": "x"}},
                ],
            }
        ],
        "messages[0].content[1].type",
    ),
    (
        "image-part-without-url",
        [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        "messages[0].content[0].image_url.url",
    ),
    (
        "image-part-in-a-system-message",
        [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, USER],
        "messages[0].content[0].type",
    ),
    (
        "refusal-part-in-a-user-message",
        [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}],
        "messages[0].content[0].type",
    ),
    ("assistant-without-content-or-calls", [USER, {"role": "assistant"}], "messages[1].content"),
    (
        "assistant-null-content-no-calls",
        [USER, {"role": "assistant", "content": None}],
        "messages[1].content",
    ),
    (
        "assistant-tool-call-without-id",
        [USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": CALL["function"]}]}],
        "messages[1].tool_calls[0].id",
    ),
    (
        "assistant-tool-call-wrong-type",
        [USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]}],
        "messages[1].tool_calls[0].type",
    ),
    (
        "tool-without-tool-call-id",
        [USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "4"}],
        "messages[2].tool_call_id",
    ),
    ("tool-without-content", [USER, {"role": "tool", "tool_call_id": "call_1"}], "messages[1].content"),
    ("function-without-name", [USER, {"role": "function", "content": "4"}], "messages[1].name"),
    ("function-without-content", [USER, {"role": "function", "name": "add"}], "messages[1].content"),
    ("name-not-a-string", [{"role": "user", "content": "hi", "name": 7}], "messages[0].name"),
]


@pytest.mark.parametrize(("messages", "param"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_bad_messages_are_400_naming_the_parameter(raw, path: str, messages: list, param: str) -> None:
    status, headers, data = raw("POST", path, {"messages": messages, "max_tokens": 1})
    assert status == 400 and headers["Content-Type"].startswith("application/json"), data
    error = json.loads(data)["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert error["message"]


# (case, messages, the dicts the chat template is given)
GOOD = [
    ("user-string", [USER], [USER]),
    (
        "every-role",
        [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Use digits."}], "name": "dev"},
            {"role": "user", "content": [{"type": "text", "text": "2 +"}, {"type": "text", "text": "2?"}]},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": "4", "tool_call_id": "call_1"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "I will not say."}]},
            {"role": "function", "content": None, "name": "add"},
            {"role": "user", "content": "", "name": "ann"},
        ],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Use digits.", "name": "dev"},
            {"role": "user", "content": "2 +\n2?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": "4", "tool_call_id": "call_1"},
            {"role": "assistant", "content": "I will not say."},
            {"role": "function", "content": "", "name": "add"},
            {"role": "user", "content": "", "name": "ann"},
        ],
    ),
    (
        "unknown-fields-ignored",
        [{**USER, "metadata": {"x": 1}}],
        [USER],
    ),
]


@pytest.mark.parametrize(("messages", "expected"), [c[1:] for c in GOOD], ids=[c[0] for c in GOOD])
def test_messages_of_every_role_reach_the_template(raw, server, messages: list, expected: list) -> None:
    status, _, data = raw("POST", "/tokenize", {"messages": messages})
    assert status == 200, data
    tokenizer = server.engine.tokenizer
    want = tokenizer.encode(tokenizer.apply_chat_template(expected), False)
    assert json.loads(data)["tokens"] == want
    status, _, data = raw("POST", CHAT, {"messages": messages, "max_tokens": 2, "temperature": 0})
    assert status == 200, data
    body = json.loads(data)
    assert (
        body["usage"]["prompt_tokens"] == len(want) and body["choices"][0]["message"]["role"] == "assistant"
    )


def test_schema_has_a_struct_per_role(server) -> None:
    """/openapi.json tells the roles apart by `role`, and each role's required fields are required there."""
    from tinypaged import __version__
    from tinypaged.server.protocol import openapi_schema

    components = openapi_schema(__version__)["components"]["schemas"]
    request = components["ChatCompletionRequest"]["properties"]["messages"]["items"]
    mapping = request["discriminator"]["mapping"]
    assert set(mapping) == {"system", "developer", "user", "assistant", "tool", "function"}
    required = {role: set(components[ref.rsplit("/", 1)[1]]["required"]) for role, ref in mapping.items()}
    assert required == {
        "system": {"role", "content"},
        "developer": {"role", "content"},
        "user": {"role", "content"},
        "assistant": {"role"},
        "tool": {"role", "content", "tool_call_id"},
        "function": {"role", "content", "name"},
    }
