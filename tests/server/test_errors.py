"""Bad input, table-driven: each case gets its documented status and OpenAI's error JSON, nothing is left
queued, and the server stays healthy with every block free."""

from __future__ import annotations

import dataclasses
import json

import pytest

MAX_MODEL_LEN = 512  # the server fixture's (tests/server/conftest.py)
MAX_NUM_SEQS = 256  # EngineConfig's default, which the fixture keeps

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_MSG = [{"role": "user", "content": "hi"}]
ANY = object()  # the case does not pin `param`


def comp(**kw: object) -> dict:
    return {"prompt": "Hello", "max_tokens": 2, **kw}


def chat(**kw: object) -> dict:
    return {"messages": OK_MSG, "max_tokens": 2, **kw}


# (case, method, path, body (bytes are sent as they are), status, expected `param`, extra headers, no key)
CASES = [
    ("malformed-json", "POST", C, b'{"prompt": "Hello", ', 400, None, {}, False),
    ("json-not-an-object", "POST", C, b"[1, 2]", 400, ANY, {}, False),
    ("empty-body", "POST", C, b"", 400, None, {}, False),
    ("missing-prompt", "POST", C, {"max_tokens": 2}, 400, ANY, {}, False),
    ("prompt-wrong-type", "POST", C, comp(prompt=5), 400, "prompt", {}, False),
    ("prompt-list-of-bools", "POST", C, comp(prompt=[True]), 400, "prompt[0]", {}, False),
    ("prompt-empty-string", "POST", C, comp(prompt=""), 400, "prompt", {}, False),
    ("prompt-empty-list", "POST", C, comp(prompt=[]), 400, "prompt", {}, False),
    ("prompt-mixed-list", "POST", C, comp(prompt=["a", 1]), 400, "prompt", {}, False),
    ("prompt-negative-token-id", "POST", C, comp(prompt=[1, -3]), 400, "prompt[1]", {}, False),
    ("prompt-token-id-past-vocab", "POST", C, comp(prompt=[1, 10**6]), 400, "prompt", {}, False),
    (
        "prompt-over-max-model-len",
        "POST",
        C,
        comp(prompt="hello " * (MAX_MODEL_LEN + 10)),
        400,
        "prompt",
        {},
        False,
    ),
    (
        "prompt-ids-over-max-model-len",
        "POST",
        C,
        comp(prompt=[1] * (MAX_MODEL_LEN + 1)),
        400,
        "prompt",
        {},
        False,
    ),
    ("max-tokens-string", "POST", C, comp(max_tokens="ten"), 400, "max_tokens", {}, False),
    ("max-tokens-zero", "POST", C, comp(max_tokens=0), 400, "max_tokens", {}, False),
    ("max-tokens-negative", "POST", C, comp(max_tokens=-5), 400, "max_tokens", {}, False),
    ("max-tokens-past-context", "POST", C, comp(max_tokens=10**9), 400, "max_tokens", {}, False),
    ("max-tokens-float", "POST", C, comp(max_tokens=2.5), 400, "max_tokens", {}, False),
    ("temperature-negative", "POST", C, comp(temperature=-0.1), 400, "temperature", {}, False),
    ("temperature-huge", "POST", C, comp(temperature=1e308), 400, "temperature", {}, False),
    ("temperature-string", "POST", C, comp(temperature="hot"), 400, "temperature", {}, False),
    ("top-p-zero", "POST", C, comp(top_p=0), 400, "top_p", {}, False),
    ("top-p-above-one", "POST", C, comp(top_p=1.5), 400, "top_p", {}, False),
    ("top-k-below-minus-one", "POST", C, comp(top_k=-5), 400, "top_k", {}, False),
    ("min-p-above-one", "POST", C, comp(min_p=2), 400, "min_p", {}, False),
    (
        "presence-penalty-out-of-range",
        "POST",
        C,
        comp(presence_penalty=5),
        400,
        "presence_penalty",
        {},
        False,
    ),
    ("repetition-penalty-zero", "POST", C, comp(repetition_penalty=0), 400, "repetition_penalty", {}, False),
    ("n-zero", "POST", C, comp(n=0), 400, "n", {}, False),
    ("n-huge", "POST", C, comp(n=10**6), 400, "n", {}, False),
    ("n-past-int64", "POST", C, comp(n=10**30), 400, "n", {}, False),
    ("best-of-below-n", "POST", C, comp(n=3, best_of=2), 400, "best_of", {}, False),
    ("best-of-huge", "POST", C, comp(best_of=10**6), 400, "best_of", {}, False),
    ("beam-search-sampling", "POST", C, comp(n=2, use_beam_search=True), 400, "temperature", {}, False),
    ("length-penalty-without-beams", "POST", C, comp(length_penalty=0.5), 400, "length_penalty", {}, False),
    ("early-stopping-without-beams", "POST", C, comp(early_stopping=True), 400, "early_stopping", {}, False),
    (
        "early-stopping-wrong-value",
        "POST",
        C,
        comp(n=2, temperature=0, use_beam_search=True, early_stopping="sometimes"),
        400,
        "early_stopping",
        {},
        False,
    ),
    ("logprobs-string", "POST", C, comp(logprobs="3"), 400, "logprobs", {}, False),
    ("logprobs-too-many", "POST", C, comp(logprobs=100), 400, "logprobs", {}, False),
    # Each prompt within the logprob-entries limit, the request's prompts together past it (limits.py).
    (
        "logprobs-entries-over-prompts",
        "POST",
        C,
        comp(prompt=[[1]] * 120, logprobs=20, max_tokens=MAX_MODEL_LEN - 1),
        400,
        "logprobs",
        {},
        False,
    ),
    (
        "prompt-logprobs-entries-over-prompts",
        "POST",
        C,
        comp(prompt=[[1] * (MAX_MODEL_LEN - 12)] * 120, echo=True, logprobs=20, max_tokens=1),
        400,
        "logprobs",
        {},
        False,
    ),
    ("seed-negative", "POST", C, comp(seed=-1), 400, "seed", {}, False),
    ("stop-empty-string", "POST", C, comp(stop=[""]), 400, "stop", {}, False),
    ("stop-wrong-type", "POST", C, comp(stop=5), 400, "stop", {}, False),
    ("stop-list-of-ints", "POST", C, comp(stop=[1, 2]), 400, "stop[0]", {}, False),
    ("stop-token-ids-negative", "POST", C, comp(stop_token_ids=[-1]), 400, "stop_token_ids[0]", {}, False),
    ("min-tokens-over-max-tokens", "POST", C, comp(min_tokens=5, max_tokens=2), 400, "min_tokens", {}, False),
    ("logit-bias-unsupported", "POST", C, comp(logit_bias={"1": 5.0}), 400, "logit_bias", {}, False),
    (
        "stream-options-wrong-type",
        "POST",
        C,
        comp(stream=True, stream_options={"include_usage": "yes"}),
        400,
        "stream_options.include_usage",
        {},
        False,
    ),
    ("stream-not-bool", "POST", C, comp(stream="yes"), 400, "stream", {}, False),
    ("invalid-utf8", "POST", C, b'{"prompt": "\xff\xfe bad", "max_tokens": 2}', 400, None, {}, False),
    ("oversized-body", "POST", C, json.dumps(comp(prompt="x" * (5 * 2**20))).encode(), 413, None, {}, False),
    ("unknown-model", "POST", C, comp(model="gpt-5"), 404, "model", {}, False),
    ("missing-key", "POST", C, comp(), 401, None, {}, True),
    ("wrong-key", "POST", C, comp(), 401, None, {"Authorization": "Bearer nope"}, True),
    ("key-without-bearer", "POST", C, comp(), 401, None, {"Authorization": "test-key"}, True),
    ("chat-messages-empty", "POST", CHAT, chat(messages=[]), 400, "messages", {}, False),
    ("chat-messages-not-a-list", "POST", CHAT, chat(messages="hi"), 400, "messages", {}, False),
    ("chat-message-not-an-object", "POST", CHAT, chat(messages=["hi"]), 400, "messages[0]", {}, False),
    ("chat-missing-messages", "POST", CHAT, {"max_tokens": 2}, 400, ANY, {}, False),
    (
        "chat-unknown-role",
        "POST",
        CHAT,
        chat(messages=[{"role": "wizard", "content": "hi"}]),
        400,
        "messages[0].role",
        {},
        False,
    ),
    (
        "chat-missing-role",
        "POST",
        CHAT,
        chat(messages=[{"content": "hi"}]),
        400,
        "messages[0].role",
        {},
        False,
    ),
    (
        "chat-content-wrong-type",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": 5}]),
        400,
        "messages[0].content",
        {},
        False,
    ),
    (
        "chat-image-part",
        "POST",
        CHAT,
        chat(
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
        ),
        400,
        "messages[0].content[0].type",
        {},
        False,
    ),
    (
        "chat-top-logprobs-without-logprobs",
        "POST",
        CHAT,
        chat(top_logprobs=2),
        400,
        "top_logprobs",
        {},
        False,
    ),
    (
        "chat-top-logprobs-too-many",
        "POST",
        CHAT,
        chat(logprobs=True, top_logprobs=50),
        400,
        "top_logprobs",
        {},
        False,
    ),
    (
        "chat-max-completion-tokens-past-context",
        "POST",
        CHAT,
        chat(max_completion_tokens=MAX_MODEL_LEN),
        400,
        "max_tokens",
        {},
        False,
    ),
    (
        "chat-prompt-over-max-model-len",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": "hello " * MAX_MODEL_LEN}]),
        400,
        "messages",
        {},
        False,
    ),
    ("chat-unknown-model", "POST", CHAT, chat(model="nope"), 404, "model", {}, False),
    ("chat-best-of-below-n", "POST", CHAT, chat(n=2, best_of=1), 400, "best_of", {}, False),
    (
        "chat-beam-search-stop-strings",  # SamplingParams' check
        "POST",
        CHAT,
        chat(n=2, temperature=0, use_beam_search=True, stop=["x"]),
        400,
        "stop",
        {},
        False,
    ),
    ("tokenize-neither-prompt-nor-messages", "POST", "/tokenize", {}, 400, "prompt", {}, False),
    ("detokenize-wrong-type", "POST", "/detokenize", {"tokens": "abc"}, 400, "tokens", {}, False),
    ("detokenize-past-vocab", "POST", "/detokenize", {"tokens": [10**7]}, 400, "tokens", {}, False),
    ("unknown-route", "GET", "/v1/engines", None, 404, None, {}, False),
    ("wrong-method", "GET", C, None, 405, None, {}, False),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param", "headers", "no_key"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_bad_input(raw, server, method, path, body, status, param, headers, no_key) -> None:
    got, resp_headers, data = raw(method, path, body, headers, auth=not no_key)
    assert got == status, data
    assert resp_headers["Content-Type"].startswith("application/json")
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param is not ANY:
        assert err["param"] == param, err


# The engine's verdicts (SamplingParams, LLMEngine.process_inputs; the server does not repeat its checks):
# (case, path, body, the param and code the engine names). The chat API calls the engine's "prompt" messages.
LONG_CHAT = [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]
ENGINE_CASES = [
    (
        "prompt-ids-fill-context",
        C,
        comp(prompt=[1] * MAX_MODEL_LEN, max_tokens=1),
        "prompt",
        "context_length_exceeded",
    ),
    ("prompt-text-too-long", C, comp(prompt="hello " * MAX_MODEL_LEN), "prompt", "context_length_exceeded"),
    (
        "second-prompt-too-long",
        C,
        comp(prompt=[[1, 2], [1] * MAX_MODEL_LEN]),
        "prompt",
        "context_length_exceeded",
    ),
    (
        "chat-prompt-too-long",
        CHAT,
        chat(messages=LONG_CHAT, max_tokens=None),
        "messages",
        "context_length_exceeded",
    ),
    ("prompt-empty", C, comp(prompt=[[]]), "prompt", None),
    ("prompt-token-id-past-vocab", C, comp(prompt=[1, 10**6]), "prompt", None),
    ("n-over-max-num-seqs", C, comp(n=MAX_NUM_SEQS + 1), "n", None),
    ("chat-n-over-max-num-seqs", CHAT, chat(n=MAX_NUM_SEQS + 1), "n", None),
    ("best-of-over-max-num-seqs", C, comp(n=2, best_of=MAX_NUM_SEQS + 1), "best_of", None),
    ("stop-token-id-past-vocab", C, comp(stop_token_ids=[10**6]), "stop_token_ids", None),
    ("chat-stop-token-id-past-vocab", CHAT, chat(stop_token_ids=[2, 10**6]), "stop_token_ids", None),
    ("best-of-below-n", C, comp(n=3, best_of=2), "best_of", None),
    ("chat-best-of-below-n", CHAT, chat(n=2, best_of=1), "best_of", None),
    ("beams-with-stop-strings", C, comp(n=2, temperature=0, use_beam_search=True, stop=["x"]), "stop", None),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(
    ("path", "body", "param", "code"), [c[1:] for c in ENGINE_CASES], ids=[c[0] for c in ENGINE_CASES]
)
def test_engine_verdict_keeps_param_and_code(raw, server, path, body, param, code, stream) -> None:
    # A stream refused before its first event gets the JSON error and its status, not a 200 stream.
    status, headers, data = raw("POST", path, {**body, "stream": stream})
    assert status == 400 and headers["Content-Type"].startswith("application/json"), data
    err = json.loads(data)["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code), err
    assert server.engine.config.max_num_seqs == MAX_NUM_SEQS


def test_explicit_max_tokens_must_fit_beside_the_prompt(raw) -> None:
    # OpenAI's rule, the server's own: the engine alone would stop at max_model_len instead.
    for stream in (False, True):
        status, _, data = raw("POST", C, comp(prompt=[1] * (MAX_MODEL_LEN - 1), max_tokens=2, stream=stream))
        err = json.loads(data)["error"]
        assert status == 400 and (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    status, _, data = raw("POST", C, comp(prompt=[1] * (MAX_MODEL_LEN - 1), max_tokens=1))
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 1
    status, _, data = raw("POST", C, comp(prompt=[1] * (MAX_MODEL_LEN - 1), max_tokens=None))
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 1  # the room left, not 16


def test_table_is_large_enough(server) -> None:
    assert server.serving.max_model_len == MAX_MODEL_LEN
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


def test_over_long_prompt_message_gives_the_lengths(raw) -> None:
    status, _, data = raw("POST", C, comp(prompt=[1] * (MAX_MODEL_LEN + 7)))
    message = json.loads(data)["error"]["message"]
    assert status == 400 and str(MAX_MODEL_LEN) in message and str(MAX_MODEL_LEN + 7) in message
    status, _, data = raw("POST", C, comp(prompt=[1] * 10, max_tokens=MAX_MODEL_LEN))
    message = json.loads(data)["error"]["message"]
    assert status == 400 and f"{MAX_MODEL_LEN + 10} tokens (10 in the prompt, {MAX_MODEL_LEN} for" in message


def test_queue_limit_counts_sequences(raw, server, monkeypatch) -> None:
    """max_queue_len counts waiting sequences (prompts x n): a request that would pass it gets 503 with
    Retry-After, one larger than the whole queue 400; the engine's count of waiting sequences is faked here (the
    engine's own count, submissions included, is tested in tests/engine/test_async_engine.py)."""
    real = server.engine.stats
    monkeypatch.setattr(server.engine, "stats", lambda: dataclasses.replace(real(), num_waiting_seqs=4))
    server.serving.max_queue_len = 6
    try:
        status, headers, data = raw("POST", C, comp(n=3))  # 4 waiting + 3 > 6
        assert status == 503 and int(headers["Retry-After"]) >= 1
        assert json.loads(data)["error"]["code"] == "overloaded"
        status, _, data = raw("POST", C, comp(prompt=["a", "b", "c"]))  # three prompts: 3 sequences too
        assert status == 503
        assert raw("POST", C, comp(n=2))[0] == 200  # 4 + 2 fits
        status, _, data = raw("POST", C, comp(n=7))  # more than the whole queue: never admissible
        assert status == 400 and json.loads(data)["error"]["param"] == "prompt"
    finally:
        server.serving.max_queue_len = None
    assert raw("POST", C, comp())[0] == 200


def test_public_paths_need_no_key_and_server_stays_healthy(raw, server) -> None:
    for path in ("/health", "/version", "/metrics", "/openapi.json"):
        assert raw("GET", path, auth=False)[0] == 200, path
    assert raw("GET", "/v1/models", auth=False)[0] == 401
    status, _, data = raw("POST", C, comp(max_tokens=2, temperature=0))
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] >= 1
