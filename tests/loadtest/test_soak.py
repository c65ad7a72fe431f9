"""The fault soak, short, against the CPU server on the default model: every kind of client runs, every check
passes; and the checks themselves fail when what they guard goes wrong."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from soak import Reference, Soak, build_parser, main
from workload import Stream


def test_short_soak(live, tmp_path: Path, capsys, api_key: str, limits: dict) -> None:
    out = tmp_path / "soak.json"
    args = ["--url", live.url, "--api-key", api_key, "--duration", "16", "--concurrency", "4"]
    args += ["--references", "4", "--output-len", "3-8", "--long-output", "24", "--stall", "2.5"]
    args += ["--burst-every", "6", "--out", str(out)]
    for name in ("max_queue_len", "idle_timeout", "max_body_bytes"):  # the server's limits, to push past
        args += ["--" + name.replace("_", "-"), str(limits[name])]
    status = main(args)
    text = capsys.readouterr().out
    assert status == 0, text
    report = json.loads(out.read_text())
    assert report["ok"] and not report["violations"]
    kinds = report["requests"]
    for kind in ("greedy", "sampled", "disconnect", "stalled_reader", "abort", "malformed", "oversized"):
        assert kinds.get(kind, 0) >= 1, kind
    assert kinds.get("body_never_arrives", 0) >= 1 and kinds.get("silent_connection", 0) >= 1
    assert report["outcomes"]["body_never_arrives"] == {"half_body_408": kinds["body_never_arrives"]}
    assert report["outcomes"]["oversized"].get("body_413", 0) >= 1
    # The bursts passed the queue: some were refused with 503 (Retry-After, code overloaded), none failed.
    assert (
        report["outcomes"]["burst"].get("503_overloaded", 0) >= 1
        and report["outcomes"]["burst"]["complete"] >= 1
    )
    assert report["outcomes"]["burst"].get("larger_than_queue_400", 0) >= 1
    assert set(report["statuses"]) <= {"200", "400", "404", "408", "413", "503"}
    assert report["greedy"].get("equal", 0) >= 2 and set(report["greedy"]) == {"equal"}
    s = report["server"]
    assert s["running"] == s["waiting"] == 0 and s["free_blocks"] == s["total_blocks"] > 0
    assert s["rss_mib_end"] > 0 and s["rss_growth_mib"] < 256
    assert "soak: OK" in text and "KV blocks free" in text


def _soak(**kw: object) -> Soak:
    args = build_parser().parse_args(["--url", "http://127.0.0.1:9"])
    return Soak(argparse.Namespace(**{**vars(args), **kw}))


def test_the_end_checks_fail_when_they_should() -> None:
    idle = {"tinypaged:num_requests_running": 0, "tinypaged:num_requests_waiting": 0}
    idle |= {"tinypaged:num_gpu_blocks": 10, "tinypaged:num_free_gpu_blocks": 10}
    soak = _soak()
    assert soak.report(idle, idle, 100.0, 100.0, True, 1.0)["ok"]
    soak.tally.statuses["500"] += 1
    report = soak.report(idle, {**idle, "tinypaged:num_free_gpu_blocks": 9}, 0.0, 300 * 2**20, False, 1.0)
    assert not report["ok"]
    text = " ".join(report["violations"])
    for what in ("HTTP 500", "not idle", "/health", "RSS grew 300 MiB"):
        assert what in text, what


def test_greedy_comparison_and_near_ties() -> None:
    ref = Reference("/v1/completions", {}, "a b c", [" a", " b", " c"])
    ref.top = [{" a": -0.1, " x": -3.0}, {" b": -0.50, " y": -0.52, " v": -0.53}, {" c": -0.2, " z": -2.0}]

    def stream(tokens: list[str]) -> Stream:
        s = Stream(start=0.0)
        s.text, s.tokens = {0: "".join(tokens).strip()}, tokens
        return s

    exact, tolerant = _soak(tie_tolerance=0.0), _soak(tie_tolerance=0.05)
    assert exact.compare(ref, stream([" a", " b", " c"])) == "equal"
    parted_at_tie = stream([" a", " y", " q"])
    assert exact.compare(ref, parted_at_tie) == "differ"
    assert tolerant.compare(ref, parted_at_tie) == "near_tie"  # 0.02 apart at the token where they parted
    assert tolerant.compare(ref, stream([" x", " b", " c"])) == "differ"  # 2.9 apart: a real difference
    assert tolerant.compare(ref, stream([" a", " v", " c"])) == "near_tie"  # third best alone, 0.03 below
    assert tolerant.compare(ref, stream([" a", " w", " c"])) == "differ"  # not among the reference's best
    assert tolerant.tally.gaps == [0.02, 2.9, 0.03, None]  # each parting's gap, for the report
