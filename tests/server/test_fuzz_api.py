"""The API fuzzed from its own /openapi.json with schemathesis, against a real server on the default model
(tight limits keep each request cheap): whatever a client sends, the server answers without a 5xx, every error
is OpenAI's JSON, every stream ends with [DONE] and no server error, and afterwards every KV block is free."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

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
