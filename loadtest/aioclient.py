"""The asyncio side of the load tools (bench_serving.py, soak.py): one streamed request read into a `Stream`,
`/metrics` read into numbers, and a wait until the server is idle with every KV block free."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
from workload import Stream, parse_metrics


@dataclass
class Reply:
    """What one request got: status, headers, the stream's accounting (streams) or the body (the rest)."""

    status: int
    headers: dict[str, str]
    stream: Stream
    body: bytes = b""


async def post_stream(session: aiohttp.ClientSession, url: str, body: dict) -> Reply:
    """POST a streamed request and read its events as they arrive (a non-200 answer's body is kept)."""
    stream = Stream(start=time.perf_counter())
    async with session.post(url, json=body) as r:
        headers = dict(r.headers)
        if r.status != 200 or not r.headers.get("Content-Type", "").startswith("text/event-stream"):
            return Reply(r.status, headers, stream, await r.read())
        async for line in r.content:
            stream.feed(line, time.perf_counter())
    return Reply(200, headers, stream)


async def get_metrics(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """The server's `/metrics` as numbers (`workload.parse_metrics`)."""
    async with session.get(base_url + "/metrics") as r:
        r.raise_for_status()
        return parse_metrics(await r.text())


def resident_memory(m: dict[str, float]) -> float | None:
    """The server's resident memory, bytes: its process's and its engine-core process's (when it has one)."""
    rss = m.get("process_resident_memory_bytes")
    if rss is None:
        return None
    return rss + m.get("tinypaged:engine_core_resident_memory_bytes", 0.0)


def is_idle(m: dict[str, float]) -> bool:
    """Nothing running, waiting or swapped, and every KV block free."""
    busy = sum(m.get(f"tinypaged:num_requests_{k}", 0) for k in ("running", "waiting", "swapped"))
    return busy == 0 and m.get("tinypaged:num_free_gpu_blocks") == m.get("tinypaged:num_gpu_blocks")


async def wait_idle(session: aiohttp.ClientSession, base_url: str, timeout: float) -> dict[str, float]:
    """Poll `/metrics` until the server is idle (`is_idle`) or `timeout` passes; the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        m = await get_metrics(session, base_url)
        if is_idle(m) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.1)
