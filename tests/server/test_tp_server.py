"""The server over a tensor-parallel engine (3 gloo ranks on the default model): streams, logprobs of the prompt
and /metrics as with one rank; then a worker killed mid-stream: the stream ends with an error event, new requests
get 503 JSON naming the worker, /health says 503, all within seconds; closing the server ends every rank."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

from prometheus_client.parser import text_string_to_metric_families

from tinypaged.server.local import child_processes

CHAT = {
    "messages": [{"role": "user", "content": "What is a page table?"}],
    "max_tokens": 12,
    "temperature": 0,
    "stream": True,
}
ECHO = {"prompt": "Paged attention", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}


def _streamed_text(body: bytes) -> str:
    chunks = [json.loads(e[len(b"data: ") :]) for e in body.strip().split(b"\n\n")[:-1]]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def _worker_pids(core_pid: int | None) -> dict[int, int]:
    """The engine core's tensor-parallel workers (its child processes), by rank."""
    assert core_pid is not None
    ranks = {}
    for pid, cmd in child_processes(core_pid):
        if m := re.search(r"tinypaged\.engine\.device\.worker --rank (\d+)", cmd):
            ranks[int(m.group(1))] = pid
    return ranks


def test_streams_logprobs_and_metrics(tp_raw, raw, tp_server) -> None:
    assert _streamed_text(tp_raw("POST", "/v1/chat/completions", CHAT)[2]) == _streamed_text(
        raw("POST", "/v1/chat/completions", CHAT)[2]
    )
    got, want = tp_raw("POST", "/v1/completions", ECHO), raw("POST", "/v1/completions", ECHO)
    assert got[0] == want[0] == 200
    a, b = (json.loads(r[2])["choices"][0]["logprobs"] for r in (got, want))
    assert a["tokens"] == b["tokens"]
    assert all(
        abs(x - y) < 1e-4 for x, y in zip(a["token_logprobs"][1:], b["token_logprobs"][1:], strict=True)
    )
    status, _, text = tp_raw("GET", "/metrics")
    metrics = {s.name: s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    assert status == 200 and metrics["tinypaged:generation_tokens_total"] >= 16
    tp_server.wait_idle()


def test_a_killed_worker_fails_the_server(tp_raw, tp_server) -> None:
    """Last in this module: the server is dead after it."""
    assert tp_raw("GET", "/health")[0] == 200
    pids = _worker_pids(tp_server.engine.core_pid)
    assert sorted(pids) == [1, 2], pids
    long = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    bodies: list[bytes] = []
    reader = threading.Thread(target=lambda: bodies.append(tp_raw("POST", "/v1/completions", long)[2]))
    reader.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    reader.join(30)
    assert b'"code":"engine_unavailable"' in bodies[0] and bodies[0].endswith(b"data: [DONE]\n\n"), bodies
    status, _, body = tp_raw("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    took = time.monotonic() - t0
    error = json.loads(body)["error"]
    assert status == 503 and error["code"] == "engine_unavailable" and error["type"] == "server_error"
    assert "worker 1" in error["message"] and "killed by signal 9" in error["message"], error
    assert tp_raw("GET", "/health")[0] == 503
    assert took < 10, took
    tp_server.close()  # ends every rank
    for pid in pids.values():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"worker pid {pid} outlived the server")
