"""One real server for the server tests: the aiohttp app over the engine client `tinypaged serve` runs (an
engine core in a process of its own, `ProcessEngine`) on the default model, listening on a free loopback port,
its event loop (uvloop) in a background thread so that the tests can use blocking clients (the official `openai`
one) and still ask the engine between requests. A test that patches the engine's own code (which runs in the
core's process) takes `inproc_server`: the same server over the session's LLMEngine in this process."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import uvloop

from tinypaged import LLM
from tinypaged.config import EngineConfig
from tinypaged.engine.frontend.async_engine import AsyncEngine
from tinypaged.engine.frontend.client import EngineClient
from tinypaged.engine.frontend.process_engine import ProcessEngine
from tinypaged.server.app import SERVING, ServerConfig, start_server, stop_server

API_KEY = "test-key"
MAX_MODEL_LEN = 512  # small, so that over-long prompts are cheap to send
IDLE_TIMEOUT = 4.0  # seconds a connection may go without a complete request


class LiveServer:
    """A running server and handles on its engine and event loop."""

    def __init__(self, engine: EngineClient, config: ServerConfig) -> None:
        self.engine = engine
        self.loop = uvloop.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(config,), name="test-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(120):
            raise RuntimeError("the test server did not start")
        self.serving = self.runner.app[SERVING]
        self.model = self.serving.model_name
        self.api_key = config.api_key
        self.auth = {"Authorization": f"Bearer {config.api_key}"}

    def _run(self, config: ServerConfig) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner, self.url = self.loop.run_until_complete(start_server(self.engine, config))
        self._ready.set()
        self.loop.run_forever()

    def call(self, fn: Any, timeout: float = 60) -> Any:
        """Run `fn()` on the server's loop (no step can start meanwhile) and return its result."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def wait_idle(self, timeout: float = 60) -> None:
        """Wait until no request is queued or running and every KV block is free, then check the pool's
        invariants (between two steps, where the engine runs)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.call(self.engine.stats)
            if stats.num_running == stats.num_waiting == stats.num_swapped == 0:
                if stats.num_free_gpu_blocks == stats.num_gpu_blocks:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle: {stats}")
            time.sleep(0.05)
        asyncio.run_coroutine_threadsafe(self.engine.check_integrity(), self.loop).result(timeout)

    def close(self) -> None:
        """Drain and stop the server, then its loop (once: a test may close it before its fixture does)."""
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(stop_server(self.runner), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


@pytest.fixture(scope="package")
def server(model_dir: Path) -> Iterator[LiveServer]:
    """The server every test in tests/server shares (the model loads once)."""
    config = EngineConfig(model=model_dir, max_model_len=MAX_MODEL_LEN)
    live = LiveServer(
        ProcessEngine(config),
        ServerConfig(
            host="127.0.0.1", port=0, api_key=API_KEY, shutdown_timeout=5.0, idle_timeout=IDLE_TIMEOUT
        ),
    )
    yield live
    live.close()


@pytest.fixture(scope="module")
def small_server(model_dir: Path) -> Iterator[LiveServer]:
    """A second server on the default model with tight limits (context 64, 4 sequences, a queue of 8), for
    tests that throw many requests at it (the API fuzz)."""
    config = EngineConfig(model=model_dir, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=128)
    live = LiveServer(
        ProcessEngine(config),
        ServerConfig(host="127.0.0.1", port=0, api_key=API_KEY, shutdown_timeout=5.0, max_queue_len=8),
    )
    yield live
    live.close()


@pytest.fixture(scope="module")
def tp_server(model_dir: Path) -> Iterator[LiveServer]:
    """A server over the default model split over 3 tensor-parallel ranks (gloo)."""
    config = EngineConfig(model=model_dir, max_model_len=MAX_MODEL_LEN, tensor_parallel_size=3)
    live = LiveServer(
        ProcessEngine(config), ServerConfig(host="127.0.0.1", port=0, api_key=API_KEY, shutdown_timeout=5.0)
    )
    yield live
    live.close()


@pytest.fixture
def inproc_server(llm: LLM) -> Iterator[LiveServer]:
    """A server over the session's LLMEngine in this process (`AsyncEngine`, `--no-engine-process`), for a test
    that patches the engine's code; closed after the test, the engine left idle."""
    assert not llm.engine.has_unfinished_requests()
    live = LiveServer(
        AsyncEngine(llm.config, engine=llm.engine),
        ServerConfig(host="127.0.0.1", port=0, api_key=API_KEY, shutdown_timeout=5.0),
    )
    yield live
    live.close()


@pytest.fixture
def tp_raw(tp_server: LiveServer) -> Iterator[Raw]:
    """Raw requests to the tensor-parallel server."""
    yield Raw(tp_server.url)


@pytest.fixture
def make_server(model_dir: Path) -> Iterator[Callable[..., LiveServer]]:
    """`make_server(api_key=None, **engine_args)`: another server on the default model (e.g. with a small KV
    cache), closed after the test."""
    started: list[LiveServer] = []

    def make(api_key: str | None = None, **engine_args: Any) -> LiveServer:
        config = EngineConfig(model=model_dir, max_model_len=MAX_MODEL_LEN, **engine_args)
        started.append(
            LiveServer(ProcessEngine(config), ServerConfig(port=0, api_key=api_key, shutdown_timeout=5.0))
        )
        return started[-1]

    yield make
    for live in started:
        live.close()


@pytest.fixture
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    """The official OpenAI client on the server; every test leaves the engine idle with all blocks free."""
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c
    server.wait_idle()


@pytest.fixture
def auth() -> dict[str, str]:
    """The header of a request with the right key."""
    return {"Authorization": f"Bearer {API_KEY}"}


class Raw:
    """A raw HTTP exchange through aiohttp's client (for SSE framing and error cases)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __call__(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        auth: bool = True,
    ) -> tuple[int, dict[str, str], bytes]:
        """Status, headers and body of one request; `body` is sent as JSON unless it is bytes."""
        headers = dict(headers or {})
        if auth:
            headers.setdefault("Authorization", f"Bearer {API_KEY}")
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
            headers.setdefault("Content-Type", "application/json")

        async def go() -> tuple[int, dict[str, str], bytes]:
            async with (
                aiohttp.ClientSession() as s,
                s.request(method, self.url + path, data=body, headers=headers) as r,
            ):
                return r.status, dict(r.headers), await r.read()

        return asyncio.run(go())


@pytest.fixture
def raw(server: LiveServer) -> Iterator[Raw]:
    """Raw requests to the server; the test leaves the engine idle with all blocks free."""
    yield Raw(server.url)
    server.wait_idle()


def _exchange(url: str, raw_request: bytes) -> bytes:
    """Send bytes as they are (any header, any framing) and return the server's answer: its head and its
    Content-Length of body, or all it sends until it closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        try:
            sock.sendall(raw_request)
        except OSError:  # closed by the server before it read everything: its answer is there to read
            pass
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
            head, sep, body = answer.partition(b"\r\n\r\n")
            lengths = [
                int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")
            ]
            if sep and lengths and len(body) >= lengths[0]:
                break
    return answer


@pytest.fixture
def exchange() -> Callable[[str, bytes], bytes]:
    """`exchange(url, raw_request)`: bytes sent as they are (any header, any framing), the answer read back."""
    return _exchange
