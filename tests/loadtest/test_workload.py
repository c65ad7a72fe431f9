"""The load tools' shared pieces: length specs, percentiles, stream accounting, the /metrics reader."""

from __future__ import annotations

import random

import numpy as np
import pytest
from workload import LengthDist, Stream, make_conversations, parse_metrics, percentiles


@pytest.mark.parametrize(
    ("spec", "lo", "hi", "mean"),
    [
        ("7", 7, 7, 7),
        ("fixed:9", 9, 9, 9),
        ("3-11", 3, 11, 7),
        ("uniform:10:20", 10, 20, 15),
        ("normal:50:5", 20, 80, 50),
        ("exponential:30", 1, 400, 30),
    ],
)
def test_length_specs(spec: str, lo: int, hi: int, mean: float) -> None:
    dist = LengthDist.parse(spec)
    rng = random.Random(0)
    xs = [dist.sample(rng) for _ in range(4000)]
    assert lo <= min(xs) and max(xs) <= hi and all(isinstance(x, int) and x >= 1 for x in xs)
    assert abs(np.mean(xs) - mean) < 0.06 * mean + 0.5


@pytest.mark.parametrize("spec", ["", "0", "9-3", "uniform:1", "normal:5", "gamma:2:3", "x", "-4", "fixed:0"])
def test_bad_length_specs_name_the_grammar(spec: str) -> None:
    with pytest.raises(ValueError, match="MIN-MAX"):
        LengthDist.parse(spec)


def test_percentiles_match_numpy() -> None:
    xs = list(np.random.default_rng(0).exponential(0.05, 999))
    got = percentiles(xs)
    for key, q in (("median", 50), ("p90", 90), ("p99", 99)):
        assert got[key] == pytest.approx(np.percentile(xs, q) * 1000)
    assert got["mean"] == pytest.approx(np.mean(xs) * 1000)
    assert percentiles([]) == {}


def _lines(*chunks: dict | str) -> list[str]:
    import json

    return [f"data: {c if isinstance(c, str) else json.dumps(c)}" for c in chunks]


def test_stream_accounting() -> None:
    s = Stream(start=10.0)
    chat_head = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    lines = _lines(
        chat_head,
        {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}},
        "[DONE]",
    )
    for t, line in zip([10.1, 10.5, 10.7, 11.0, 11.0, 11.0], lines, strict=True):
        s.feed(line, t)
    s.feed("", 11.0)  # the blank lines between events
    assert s.ttft == pytest.approx(0.5) and s.itl == pytest.approx(
        [0.2, 0.3]
    )  # the role-only chunk is no output
    assert s.text == {0: "Hello!"} and s.output_tokens == 3 and s.prompt_tokens == 5
    assert s.check(max_tokens=3, exact=True) == []
    assert s.check(max_tokens=4, exact=True) == ["3 completion tokens, max_tokens 4"]
    assert s.check(choices=2) == ["finish reasons for choices [0], expected 2"]


def test_ill_formed_streams_are_caught() -> None:
    s = Stream(start=0.0)
    for line in _lines(
        {"choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]},
        {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
        "{not json",
        {"error": {"message": "boom", "type": "server_error"}},
    ):
        s.feed(line, 1.0)
    problems = s.check()
    assert "choice 0 finished twice" in problems and "no [DONE]" in problems and "no usage chunk" in problems
    assert any(p.startswith("not JSON") for p in problems) and any("boom" in p for p in problems)
    s.feed("data: [DONE]", 1.0)
    s.feed("data: {}", 1.0)
    assert "data after [DONE]" in s.check()


def test_conversations_are_reproducible() -> None:
    args = (LengthDist.parse("2-4"), LengthDist.parse("3-6"), LengthDist.parse("8"), 5)
    a, b = make_conversations(6, *args), make_conversations(6, *args)
    assert a == b and all(2 <= len(c.user_messages) == len(c.output_lens) <= 4 for c in a)
    assert a != make_conversations(6, *args[:3], 6)


def test_parse_metrics() -> None:
    text = "\n".join(
        [
            "# HELP tinypaged:num_requests_running x",
            'tinypaged:num_requests_running{model_name="m"} 2',
            'tinypaged:request_success_total{model_name="m",finished_reason="abort"} 3',
            'tinypaged:e2e_request_latency_seconds_bucket{model_name="m",le="+Inf"} 7',
            "process_resident_memory_bytes 1.5e9",
        ]
    )
    m = parse_metrics(text)
    assert m["tinypaged:num_requests_running"] == 2
    assert m['tinypaged:request_success_total{finished_reason="abort"}'] == 3
    assert m['tinypaged:e2e_request_latency_seconds_bucket{le="+Inf"}'] == 7
    assert m["process_resident_memory_bytes"] == 1.5e9
