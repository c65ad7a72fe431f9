"""The API fuzzed from its own /openapi.json with schemathesis, against a real server on the default model
(tight limits keep each request cheap): whatever a client sends, the server answers without a 5xx, every error
is OpenAI's JSON, every stream ends with [DONE] and no server error, and afterwards every KV block is free.
Hostile bodies too: random JSON in the API's fields, nested past any depth, under any content coding."""

from __future__ import annotations

import gzip
import json
import zlib
from collections import Counter
from collections.abc import Iterator

import brotli
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinypaged import __version__
from tinypaged.server.protocol import openapi_schema

schema = schemathesis.openapi.from_dict(openapi_schema(__version__))
SEEN: Counter[str] = Counter()
EXPECTED = {200, 400, 401, 404, 405, 413, 503}


@pytest.fixture(scope="module", autouse=True)
def report(small_server) -> Iterator[None]:  # noqa: ANN001
    yield
    small_server.wait_idle()
    print(f"\nAPI fuzz, requests by operation and status: {dict(sorted(SEEN.items()))}")


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error(case, small_server) -> None:  # noqa: ANN001
    response = case.call(base_url=small_server.url, headers=small_server.auth, timeout=120)
    label = f"{case.method} {case.path}"
    SEEN[f"{label} {response.status_code}"] += 1
    assert response.status_code in EXPECTED, f"{label}: {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"], response.text[:300]
    elif response.headers.get("Content-Type", "").startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
        assert events[-1] == "[DONE]", response.text[-300:]
        for event in events[:-1]:
            body = json.loads(event)
            assert "error" not in body or body["error"]["type"] != "server_error", event


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)
FIELDS = ["prompt", "messages", "tools", "tool_choice", "response_format", "structured_outputs", "n", "stop"]
CODINGS = {
    "gzip": gzip.compress,
    "deflate": zlib.compress,
    "br": brotli.compress,
    "identity": lambda b: b,
}


@st.composite
def hostile_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """A body of random JSON in the API's fields (or random bytes), maybe deeply nested somewhere, maybe
    compressed (under a right or a wrong Content-Encoding), and its headers after the request line."""
    if draw(st.booleans()):
        body = json.dumps(draw(st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=4))).encode()
    else:
        body = draw(st.binary(max_size=300))
    depth = draw(st.sampled_from([0, 0, 63, 65, 999, 5000]))
    if depth and body.startswith(b"{"):
        body = (
            b'{"'
            + draw(st.sampled_from(FIELDS)).encode()
            + b'": '
            + b"[" * depth
            + b"]" * depth
            + b", "
            + body[1:]
        )
    coding = draw(st.sampled_from([None, *CODINGS]))
    if coding is not None:
        body = CODINGS[draw(st.sampled_from(list(CODINGS)))](body)  # the right coding, or another
    headers = b"Content-Type: application/json\r\n" + (
        f"Content-Encoding: {coding}\r\n".encode() if coding else b""
    )
    return headers, body


@given(
    request_case=hostile_bodies(),
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]),
)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_hostile_bodies_get_no_server_error(small_server, exchange, request_case, path) -> None:  # noqa: ANN001
    """Random JSON in the API's fields, nested past any depth, compressed under any coding: a 4xx in OpenAI's
    JSON, or a 200; never a 5xx."""
    headers, body = request_case
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode()
    head += f"Authorization: {small_server.auth['Authorization']}\r\n".encode() + headers
    answer = exchange(small_server.url, head + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    status = int(answer.split(b" ", 2)[1])
    SEEN[f"hostile {path} {status}"] += 1
    assert status < 500 or status == 503, answer[:500]
    data = answer.partition(b"\r\n\r\n")[2]
    if status >= 400:
        assert json.loads(data)["error"]["message"], data[:300]
