"""`tinypaged serve --replicas 1 --max-replicas 2` as a user runs it, in a process of its own (which starts Ray on
2 logical CPUs and stops it): it scales up to two replicas while requests queue past the target and back down to
one once they stop, no request failing meanwhile; then SIGTERM stops it within seconds, leaving no process behind.

The CLI's autoscaling config is used as it sets it (min, max, target), except Ray Serve's delays, shortened
through the app's `autoscaling` argument, and its metric push intervals, through its environment, so that both
changes happen within seconds. The replicas are counted on the aggregated `/metrics`, as a user would see them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

pytest.importorskip("ray.serve")
psutil = pytest.importorskip("psutil")

PORT = 8939
# The CLI, with Ray Serve's autoscaling delays shortened for the test (its min, max and target: the flags').
LAUNCH = """
import sys
from tinypaged import cli
from tinypaged.replicas import launch
serve_replicas = launch.serve_replicas
def quick(args, *rest):
    args["autoscaling"] = {"upscale_delay_s": 1.0, "downscale_delay_s": 2.0, "look_back_period_s": 2.0}
    return serve_replicas(args, *rest)
launch.serve_replicas = quick
sys.exit(cli.main(sys.argv[1:]))
"""
FLAGS = ["serve", "--replicas", "1", "--max-replicas", "2", "--max-model-len", "256", "--max-num-seqs", "2"]
FAST_METRICS = {  # Ray Serve reads these in each process it starts: how often queue depths are reported
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[subprocess.Popen, str]]:
    argv = [*FLAGS, "--num-gpu-blocks-override", "64", "--host", "127.0.0.1", "--port", str(PORT)]
    env = {**os.environ, **FAST_METRICS}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # Ray's and Serve's log lines, then the URL once every replica answers
            if " serving " in line:
                break
        else:
            raise AssertionError(f"tinypaged serve --replicas exited with {proc.wait()}")
        threading.Thread(
            target=proc.stdout.read, daemon=True
        ).start()  # drained, so it never blocks on a write
        yield proc, f"http://127.0.0.1:{PORT}"
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()


def replicas_in_metrics(url: str) -> int:
    """Replicas on the aggregated /metrics (one that stopped leaves it)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    rows = [line for line in text.splitlines() if line.startswith("tinypaged:prefix_cache_queries_total{")]
    return len({row.split('replica="')[1].split('"')[0] for row in rows})


def wait_for(url: str, replicas: int, timeout: float) -> None:
    start = time.monotonic()
    while replicas_in_metrics(url) != replicas:
        assert time.monotonic() - start < timeout, f"not {replicas} replicas after {timeout} s"
        time.sleep(0.5)


def _load(url: str, stop: threading.Event, statuses: list[int]) -> None:
    """Completions one after another until `stop`: one client's share of the queue."""
    body = json.dumps({"prompt": "Tell a story about ships", "max_tokens": 24, "ignore_eos": True}).encode()
    while not stop.is_set():
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            statuses.append(r.status)


def test_replicas_scale_up_under_queue_depth_and_back_down(server: tuple[subprocess.Popen, str]) -> None:
    _, url = server
    wait_for(url, 1, timeout=10)
    stop, statuses = threading.Event(), []
    clients = [threading.Thread(target=_load, args=(url, stop, statuses)) for _ in range(20)]
    for c in clients:
        c.start()
    try:
        wait_for(url, 2, timeout=90)  # 20 ongoing (most queued: 2 run at once) against the CLI's target, 8
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=120)
    assert not any(c.is_alive() for c in clients), "a request hung"
    wait_for(url, 1, timeout=60)
    assert statuses and set(statuses) == {200}


def test_sigterm_stops_it_within_seconds_and_leaves_no_process(server: tuple[subprocess.Popen, str]) -> None:
    proc, _ = server
    family = psutil.Process(proc.pid).children(recursive=True)  # Ray's processes, its workers, the engines
    assert family
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    took = time.monotonic() - start
    _, alive = psutil.wait_procs(family, timeout=5)
    assert not alive, f"left running: {[p.name() for p in alive]}"
    assert took < 10, f"SIGTERM to exit took {took:.1f} s"
