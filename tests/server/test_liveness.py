"""Liveness: a stopped engine core is declared stalled within the stall timeout, idle or streaming (`/health`
503 naming it, its requests fail instead of hanging, new ones are refused) and serves again once resumed, its
aborted requests' blocks freed; a dead core's load is left out of `/metrics`, which says why. In-process, a slow
step is not a stall, and a stuck one is, until it returns."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from tinypaged import LLM, SamplingParams
from tinypaged.config import EngineConfig
from tinypaged.engine.frontend.async_engine import AsyncEngine
from tinypaged.engine.frontend.process_engine import ProcessEngine
from tinypaged.errors import EngineDeadError
from tinypaged.server.app import ServerConfig, start_server, stop_server

# Short, yet longer than a step of these small requests on a loaded CPU (up to 2 s for a fresh core's first).
STALL_S = 4.0
MARGIN_S = 3.0  # the heartbeat's period, the watchdog's, and a loaded machine's scheduling
GAUGES = ("num_requests_running", "num_requests_waiting", "gpu_cache_usage_perc", "num_free_gpu_blocks")


async def _health(s: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    async with s.get(url + "/health") as r:
        return r.status, await r.json()


async def _until_health(s: aiohttp.ClientSession, url: str, status: int, within: float) -> tuple[float, dict]:
    """Seconds until /health answers `status` (AssertionError after `within`), and its body."""
    t0 = time.monotonic()
    while True:
        got, body = await _health(s, url)
        if got == status:
            return time.monotonic() - t0, body
        assert time.monotonic() - t0 < within, (got, body)
        await asyncio.sleep(0.1)


async def _metrics(s: aiohttp.ClientSession, url: str) -> tuple[str, dict[str, list]]:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return text, {f.name: f.samples for f in text_string_to_metric_families(text)}


async def _complete(
    s: aiohttp.ClientSession, url: str, stream: bool, max_tokens: int = 4
) -> tuple[int, list]:
    """A completion's status, and its events (streamed) or its body."""
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    async with s.post(url + "/v1/completions", json=body) as r:
        if not stream or r.status != 200:
            return r.status, [await r.json()]
        return r.status, [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: {")]


def test_a_stopped_core_stalls_and_resumes_and_a_dead_one_leaves_metrics(model_dir: Path) -> None:
    engine = ProcessEngine(EngineConfig(model=model_dir, seed=0, max_model_len=512), stall_timeout=STALL_S)
    core = engine.core_pid
    assert core is not None

    async def until_idle() -> None:  # the aborts of a stall reached the core: every block is free again
        for _ in range(200):
            stats = engine.stats()
            if (
                stats.num_running == stats.num_waiting == 0
                and stats.num_free_gpu_blocks == stats.num_gpu_blocks
            ):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(engine.stats())

    async def main() -> None:
        runner, url = await start_server(engine, ServerConfig(port=0))
        try:
            async with aiohttp.ClientSession() as s:
                assert (await _health(s, url))[0] == 200
                # (The first steps of a fresh core set up its kernels: on a loaded CPU they may take seconds.)
                assert (await _complete(s, url, stream=False))[0] == 200
                _, families = await _metrics(s, url)
                assert families["tinypaged:engine_healthy"][0].value == 1
                assert all(f"tinypaged:{g}" in families for g in GAUGES)

                # Idle: no step is due, but the heartbeat stops.
                os.kill(core, signal.SIGSTOP)
                took, body = await _until_health(s, url, 503, STALL_S + MARGIN_S)
                assert "stalled" in body["message"] and "heartbeat" in body["message"], body
                status, [refused] = await _complete(s, url, stream=False)
                assert status == 503 and "stalled" in refused["error"]["message"], refused
                text, families = await _metrics(s, url)
                assert families["tinypaged:engine_healthy"][0].value == 0 and "stalled" in text
                assert not any(f"tinypaged:{g}" in families for g in GAUGES), text
                os.kill(core, signal.SIGCONT)
                await _until_health(s, url, 200, MARGIN_S)
                assert (await _complete(s, url, stream=False))[0] == 200

                # Streaming: the stream ends with an error event instead of waiting for the core.
                stream = asyncio.create_task(_complete(s, url, stream=True, max_tokens=400))
                while engine.stats().num_running == 0:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.3)
                os.kill(core, signal.SIGSTOP)
                t0 = time.monotonic()
                status, events = await asyncio.wait_for(stream, STALL_S + MARGIN_S)
                assert time.monotonic() - t0 < STALL_S + MARGIN_S
                assert status == 200 and "stalled" in events[-1]["error"]["message"], events[-1]
                assert events[-1]["error"]["code"] == "engine_unavailable"
                assert (await _health(s, url))[0] == 503
                os.kill(core, signal.SIGCONT)
                await _until_health(s, url, 200, MARGIN_S)
                await until_idle()
                await engine.check_integrity()
                status, events = await _complete(s, url, stream=True, max_tokens=4)
                assert status == 200 and events[-1]["choices"][0]["finish_reason"] == "length", events

                # Dead: its load is unknown, its counters stay, the health gauge says why.
                os.kill(core, signal.SIGKILL)
                _, body = await _until_health(s, url, 503, 10)
                assert "exited" in body["message"], body
                text, families = await _metrics(s, url)
                assert families["tinypaged:engine_healthy"][0].value == 0 and "exited" in text
                assert not any(f"tinypaged:{g}" in families for g in GAUGES), text
                assert "tinypaged:engine_core_resident_memory_bytes" not in families
                assert families["tinypaged:generation_tokens"][0].value > 0
                assert "process_resident_memory_bytes" in families  # the server's own
        finally:
            await stop_server(runner)

    uvloop.run(main())
    assert not Path(f"/proc/{core}").exists()  # exited and reaped: no orphan


def test_a_slow_step_is_no_stall_and_a_stuck_one_is_until_it_returns(llm: LLM, monkeypatch) -> None:
    """In-process: steps of 1 s and more under a 2 s stall timeout never trip it; a 6 s step does (its request
    fails, new ones are refused), and the engine serves again once the step returns, every block freed."""
    delay = [1.0]
    step = llm.engine.step

    def slow_step():  # noqa: ANN202
        time.sleep(delay[0])
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)
    engine = AsyncEngine(llm.config, engine=llm.engine, stall_timeout=2.0)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)

    async def main() -> None:
        await engine.start()
        seen: list[str | None] = []
        outs = []
        async for out in engine.generate("Once upon a time", params, "slow"):
            outs.append(out)
            seen.append(engine.unavailable)
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4 and seen == [None] * len(outs)

        delay[0] = 6.0
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="stalled"):
            async for _ in engine.generate("Once upon a time", params, "stuck"):
                pass
        assert time.monotonic() - t0 < 4.5
        assert engine.unavailable is not None and "stuck in a step" in engine.unavailable
        with pytest.raises(EngineDeadError, match="stalled"):
            engine.generate("x", params, "refused")
        delay[0] = 0.0
        for _ in range(200):
            if engine.unavailable is None:
                break
            await asyncio.sleep(0.05)
        assert engine.unavailable is None
        outs = [out async for out in engine.generate("Once upon a time", params, "after")]
        assert outs[-1].finished
        stats = engine.stats()
        assert (
            stats.num_running == stats.num_waiting == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks
        )
        await engine.shutdown()

    uvloop.run(main())
    llm.engine.check_integrity()
