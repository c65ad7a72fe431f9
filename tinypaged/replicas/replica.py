"""One Ray Serve replica: a whole `tinypaged serve` (engine and aiohttp server) on a Unix socket of its own, which
the ingress's requests are relayed to byte for byte; and the board its metrics are gathered on.

The replica answers with the server's own code, so every rule of the API (its schema, errors, auth, limits,
streaming) holds behind Ray exactly as without it. What Ray adds is read here: the routing stats (the keys of the
block hashes its engine has cached, kept by replaying the engine's prefix-cache events as each step reports
them; its queue; its KV usage) and a health check (the engine's own verdict).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import aiohttp

from tinypaged.config import STALL_TIMEOUT_S, EngineConfig
from tinypaged.engine.step.stats import StepStats
from tinypaged.replicas.metrics import merge_expositions
from tinypaged.replicas.routing import CachedBlocks, RoutedRequest

logger = logging.getLogger(__name__)

# Headers that describe one connection, not the message: never relayed (RFC 9110, 7.6.1), nor the length, which
# the relaying side sets again.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host"}
)
PUSH_EVERY_S = 1.0  # how often a replica posts its /metrics to the board
STALE_AFTER_S = 5.0  # a replica silent this long (gone) leaves the aggregated /metrics


@dataclass
class ResponseHead:
    """The status, headers and first bytes of a relayed response: the first item of `EngineReplica.forward`'s
    stream. Its first bytes come with it (a stream's first event, sent after the request's first step), so a
    replica that dies before the client has any of the body fails the item the ingress waits on, and the
    ingress offers the request to another replica."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes = b""


class EngineReplica:
    """A tinypaged engine and its HTTP server, as one Ray Serve replica (app.py deploys it)."""

    async def __init__(
        self,
        engine_kwargs: dict[str, Any],
        server_kwargs: dict[str, Any],
        board: Any = None,
        engine_process: bool = True,
        stall_timeout: float = STALL_TIMEOUT_S,
    ) -> None:
        from ray import serve

        from tinypaged.engine.frontend.async_engine import AsyncEngine
        from tinypaged.engine.frontend.process_engine import ProcessEngine
        from tinypaged.server.app import ServerConfig, start_server

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        config = EngineConfig(**engine_kwargs)
        kind = ProcessEngine if engine_process else AsyncEngine
        self.engine = kind(config, stall_timeout=stall_timeout)
        self.cached = CachedBlocks()
        self.engine.add_step_listener(self._on_step)
        self._dir = tempfile.mkdtemp(prefix="tinypaged-replica-")
        socket = os.path.join(self._dir, "http.sock")
        self.runner, _ = await start_server(self.engine, ServerConfig(**server_kwargs, unix_socket=socket))
        # auto_decompress off: bodies pass through as the server sent them.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=socket, limit=0),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None),
        )
        self.board = board
        self._pusher = asyncio.create_task(self._push_metrics()) if board is not None else None

    def _on_step(self, stats: StepStats) -> None:
        self.cached.apply(stats.kv_events)

    async def forward(self, route: RoutedRequest) -> AsyncGenerator[ResponseHead | bytes, None]:
        """Relay one HTTP request to this replica's server: its response's head (naming this replica in
        `x-tinypaged-replica`), then its body as it comes (a stream's events one by one). Closing the stream
        early (the client gone) closes the connection, which aborts the request in the engine as a client
        leaving `tinypaged serve` does."""
        url = f"http://replica{route.path}" + (f"?{route.query}" if route.query else "")
        drop = HOP_BY_HOP | {
            "content-length"
        }  # the body may have been cut short (ingress.py): its own length
        headers = [(k, v) for k, v in route.headers if k.lower() not in drop]
        async with self.session.request(
            route.method, url, headers=headers, data=route.body or None, skip_auto_headers=("User-Agent",)
        ) as resp:
            keep = [(k, v) for k, v in _raw_headers(resp) if k.lower() not in HOP_BY_HOP]
            pieces = whole_events(resp.content) if is_event_stream(keep) else resp.content.iter_any()
            first = await anext(pieces, b"")
            yield ResponseHead(resp.status, [*keep, ("x-tinypaged-replica", self.replica_id)], first)
            async for chunk in pieces:
                yield chunk

    async def metrics_text(self) -> str:
        """This replica's /metrics, as its server renders it."""
        async with self.session.get("http://replica/metrics") as resp:
            return await resp.text()

    async def _push_metrics(self) -> None:
        while True:
            try:
                await self.board.put.remote(self.replica_id, await self.metrics_text())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the next push tries again
                logger.warning("could not post /metrics to the board", exc_info=True)
            await asyncio.sleep(PUSH_EVERY_S)

    def record_routing_stats(self) -> dict[str, Any]:
        """What routers read (router.py): the cached block keys, the queue, the batch's size, the KV usage."""
        stats = self.engine.stats()
        return {
            "block_keys": list(self.cached.keys),
            "version": self.cached.version,
            "published_at": time.time(),
            "kv_usage": stats.gpu_cache_usage,
            "num_requests": stats.num_running + stats.num_waiting,
            "max_num_seqs": self.engine.config.max_num_seqs,  # beyond it, a request waits for a slot
        }

    def check_health(self) -> None:
        """Ray Serve's health check: the engine dead or stalled fails it, and Serve replaces the replica."""
        why = self.engine.unavailable
        if why is not None:
            raise RuntimeError(f"the engine cannot serve: {why}")

    async def __del__(self) -> None:
        """Serve stopping the replica (after its requests drained): leave the board, stop the server and its
        engine (`stop_server`: the engine's core process too). The board may be stopping as well: a short wait,
        then it drops this replica by itself (STALE_AFTER_S)."""
        from tinypaged.server.app import stop_server

        if self._pusher is not None:
            self._pusher.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.board.drop.remote(self.replica_id), 1.0)
        with contextlib.suppress(Exception):
            await self.session.close()
        await stop_server(self.runner)


def is_event_stream(headers: list[tuple[str, str]]) -> bool:
    """Whether a response's headers say its body is server-sent events."""
    return any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in headers)


async def whole_events(content: aiohttp.StreamReader) -> AsyncGenerator[bytes, None]:
    """A server-sent event body in whole events (each ends in a blank line), however its bytes arrive: a stream
    the replica's death cuts off ends between two events, never inside one, before the ingress's error event."""
    pending = b""
    async for piece in content.iter_any():
        pending += piece
        end = pending.rfind(b"\n\n") + 2
        if end >= 2:
            yield pending[:end]
            pending = pending[end:]
    if pending:  # the server ended without a blank line (not ours): what it sent, as sent
        yield pending


def _raw_headers(resp: aiohttp.ClientResponse) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in resp.raw_headers]


class MetricsBoard:
    """Where replicas post their /metrics; the ingress's /metrics is all of them, each sample labelled with its
    replica (a replica that stopped posting drops out after STALE_AFTER_S)."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        """A replica's latest exposition."""
        self._texts[replica] = (time.monotonic(), text)

    def drop(self, replica: str) -> None:
        """A replica shut down."""
        self._texts.pop(replica, None)

    def render(self) -> str:
        """Every live replica's metrics in one exposition, each sample labelled `replica`."""
        now = time.monotonic()
        live = {r: text for r, (at, text) in sorted(self._texts.items()) if now - at < STALE_AFTER_S}
        return merge_expositions(live)
