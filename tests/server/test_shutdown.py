"""`tinypaged serve` as a process: SIGTERM stops accepting, lets in-flight requests finish within the
shutdown timeout, aborts the ones still running at its end, and exits 0, its engine-core process with it; a
core that dies makes every request fail with a 503 at once."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tinypaged.server.local import child_processes, engine_core_pid


@pytest.fixture
def serve_process(model_dir: Path):
    """A `tinypaged serve` process on a free loopback port, and its URL."""
    exe = Path(sys.executable).parent / "tinypaged"
    proc = subprocess.Popen(
        [
            str(exe),
            "serve",
            "--model",
            str(model_dir),
            "--port",
            "0",
            "--max-model-len",
            "512",
            "--shutdown-timeout",
            "3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line or "serving" in line:
                break
        match = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert match, f"no URL in the server's output: {line!r}"
        yield proc, match.group(0)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


async def _stream(url: str, max_tokens: int, started: asyncio.Event) -> tuple[list[dict], bool]:
    """The chunks of one streamed completion, and whether it ended with [DONE]."""
    chunks: list[dict] = []
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
            async for line in r.content:
                if line == b"data: [DONE]\n":
                    return chunks, True
                if line.startswith(b"data: "):
                    chunks.append(json.loads(line[6:]))
                    started.set()
    except aiohttp.ClientError:
        pass  # cut off at the shutdown timeout
    return chunks, False


async def _refused(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            return r.status == 503
    except aiohttp.ClientConnectionError:
        return True


def test_sigterm_drains_then_exits_zero(serve_process) -> None:
    proc, url = serve_process

    async def scenario() -> tuple:
        short_started, long_started = asyncio.Event(), asyncio.Event()
        short = asyncio.create_task(_stream(url, 12, short_started))
        long = asyncio.create_task(_stream(url, 450, long_started))
        await asyncio.wait_for(asyncio.gather(short_started.wait(), long_started.wait()), 60)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        refused = await _refused(url)
        results = await asyncio.gather(short, long)
        return refused, results, time.monotonic() - t0

    refused, ((short_chunks, short_done), (long_chunks, long_done)), took = asyncio.run(scenario())
    assert refused, "new requests were still served after SIGTERM"
    assert short_done and short_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"]) for c in short_chunks) >= 1
    # 450 tokens take far longer than the 3 s shutdown timeout here: the long request was cut off
    assert not long_done and took < 30
    assert proc.wait(30) == 0
    output = proc.stdout.read()
    assert "Traceback" not in output, output


def test_a_dead_engine_core_answers_503_and_the_server_still_exits_cleanly(serve_process) -> None:
    proc, url = serve_process
    core = engine_core_pid(proc.pid)
    assert core is not None, child_processes(proc.pid)

    async def scenario() -> tuple:
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            metrics = await r.text()
        # The core's resident memory is reported beside the server's (the model lives there).
        line = next(
            x for x in metrics.splitlines() if x.startswith("tinypaged:engine_core_resident_memory_bytes")
        )
        statm = Path(f"/proc/{core}/statm").read_text().split()
        assert 0.5 < float(line.split()[-1]) / (int(statm[1]) * os.sysconf("SC_PAGE_SIZE")) < 2
        started = asyncio.Event()
        stream = asyncio.create_task(_stream(url, 450, started))
        await asyncio.wait_for(started.wait(), 60)
        t0 = time.monotonic()
        os.kill(core, signal.SIGKILL)
        streamed = await stream
        took = time.monotonic() - t0
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                health = r.status
            body = {"prompt": "Hello", "max_tokens": 4}
            async with s.post(url + "/v1/completions", json=body) as r:
                refused = r.status, await r.json()
        return streamed, took, health, refused

    (chunks, done), took, health, (status, body) = asyncio.run(scenario())
    # The stream ends with an error event (then [DONE]), within seconds of the core's death.
    assert done and "engine process exited" in chunks[-1]["error"]["message"] and took < 10
    assert health == 503
    assert status == 503 and "engine process exited" in body["error"]["message"], body
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not child_processes(proc.pid)
