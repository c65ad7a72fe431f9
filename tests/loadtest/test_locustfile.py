"""A short headless locust run on the real `locust` against the CPU server on the default model: both user
classes, no failures, and the token metrics in locust's stats CSV agree with what was asked."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"


def test_headless_locust_run(live, tmp_path: Path, api_key: str) -> None:
    locust = Path(sys.executable).parent / "locust"
    cmd = [
        str(locust),
        "-f",
        str(LOADTEST / "locustfile.py"),
        "--headless",
        "--users",
        "3",
        "--spawn-rate",
        "3",
    ]
    cmd += ["--run-time", "12s", "--host", live.url, "--csv", str(tmp_path / "run"), "--only-summary"]
    cmd += ["--prompt-len", "8-32", "--chat-turns", "2"]
    # The API key and the output lengths come from the environment, the rest from flags.
    env = {**os.environ, "TINYPAGED_API_KEY": api_key, "TINYPAGED_OUTPUT_LEN": "4-10"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(tmp_path / "run_stats.csv"))}
    for path in ("/v1/completions", "/v1/chat/completions"):
        post, tokens = rows[("POST", path)], rows[("TOKENS", path)]
        requests = int(post["Request Count"])
        assert requests >= 1 and int(post["Failure Count"]) == 0, post
        assert int(rows[("TTFT", path)]["Request Count"]) == requests == int(tokens["Request Count"])
        # EOS is ignored: every request produced its drawn max_tokens, 4 to 10 (the TOKENS entry's "times").
        assert 4 <= float(tokens["Min Response Time"]) <= float(tokens["Max Response Time"]) <= 10, tokens
        assert float(post["Average Content Size"]) == float(tokens["Average Response Time"])
        assert int(rows[("ITL", path)]["Request Count"]) >= 3 * requests  # at least 3 gaps per request
        assert 0 < float(rows[("TTFT", path)]["Median Response Time"]) < float(post["Median Response Time"])
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0
    assert "tinypaged /v1/completions:" in done.stdout + done.stderr
