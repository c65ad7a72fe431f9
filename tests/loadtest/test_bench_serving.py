"""bench_serving against the CPU server on the default model: a two-rate sweep of the random workload and a
multi-turn chat run, their figures checked against what was sent, the /metrics samples and the plots."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from bench_serving import _gaps, main


def test_random_workload_sweep(live, tmp_path: Path, capsys, api_key: str) -> None:
    out = tmp_path / "r.json"
    args = ["--url", live.url, "--api-key", api_key, "--num-prompts", "6", "--prompt-len", "8", "32"]
    args += [
        "--output-len",
        "4-12",
        "--vocab",
        "49152",
        "--request-rate",
        "3",
        "inf",
        "--metrics-interval",
        "0.2",
    ]
    args += ["--goodput", "ttft:60000", "tpot:1", "--out", str(out), "--plot-dir", str(tmp_path)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert [r["request_rate"] for r in result["runs"]] == [3, math.inf]
    # The same seeded workload in each run: EOS ignored, so the output tokens are the drawn lengths.
    totals = {r["summary"]["total_output_tokens"] for r in result["runs"]}
    assert len(totals) == 1 and 6 * 4 <= totals.pop() <= 6 * 12
    for run in result["runs"]:
        s = run["summary"]
        assert (s["completed"], s["failed"]) == (6, 0)
        assert s["ttft_ms"]["median"] <= s["ttft_ms"]["p99"] <= s["e2el_ms"]["p99"]
        assert s["tpot_ms"]["mean"] > 1  # so no request meets the 1 ms TPOT SLO: goodput 0
        assert s["goodput"]["good_requests"] == 0
        assert len(run["cdf"]["ttft_ms"]) == 6 and run["cdf"]["itl_ms"] == sorted(run["cdf"]["itl_ms"])
        assert run["metrics_samples"] and max(x["kv_usage"] for x in run["metrics_samples"]) > 0
        assert 6 * 8 <= s["total_input_tokens"] <= 6 * 32
    sat = result["saturation"]
    assert sat["output_throughput"] == max(r["summary"]["output_throughput"] for r in result["runs"])
    for name in ("latency_cdf.png", "throughput_latency.png", "kv_and_queues.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    # Plotting a saved result sends nothing and draws the same files.
    (tmp_path / "again").mkdir()
    assert main(["--plot-from", str(out), "--plot-dir", str(tmp_path / "again")]) == 0
    assert len(list((tmp_path / "again").glob("*.png"))) == 3
    assert "saturation:" in capsys.readouterr().out


def test_multi_turn_chats_carry_their_history(live, tmp_path: Path, api_key: str) -> None:
    out = tmp_path / "mt.json"
    args = ["--url", live.url, "--api-key", api_key, "--dataset", "multi-turn", "--num-prompts", "2"]
    args += [
        "--turns",
        "3",
        "--prompt-len",
        "6",
        "--output-len",
        "5",
        "--request-rate",
        "inf",
        "--per-request",
    ]
    args += ["--out", str(out), "--metrics-interval", "0"]
    assert main(args) == 0
    [run] = json.loads(out.read_text())["runs"]
    assert run["summary"]["completed"] == 6 and run["summary"]["total_output_tokens"] == 30
    # Each conversation's requests, in order: each turn's prompt holds the last (its answer and a new message).
    by_start = sorted(run["requests"], key=lambda r: r["start"])
    lens = sorted(r["prompt_len"] for r in by_start)
    assert lens[-1] > lens[0] + 2 * 5  # the third turns carry two answers of 5 tokens and two more messages


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_have_the_rate_and_burstiness(burstiness: float) -> None:
    gaps = np.array(_gaps(random.Random(3), 20000, 8.0, burstiness))
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.05)
    # A gamma of shape k has a coefficient of variation of 1 / sqrt(k): 1 for Poisson arrivals.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)
    assert _gaps(random.Random(3), 4, math.inf, burstiness) == [0.0] * 4
