"""The relay between the ingress and a replica's server, without Ray running: a replica's first item carries the
response's first bytes (so a replica that dies before the client has any byte fails over), and a stream cut off
mid-way ends after its last whole event."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

pytest.importorskip("ray")

from ray.exceptions import RayActorError  # noqa: E402

from tinypaged.replicas import ingress as ingress_module  # noqa: E402
from tinypaged.replicas.ingress import Ingress  # noqa: E402
from tinypaged.replicas.replica import EngineReplica, ResponseHead  # noqa: E402
from tinypaged.replicas.routing import RoutedRequest  # noqa: E402

SSE = [("Content-Type", "text/event-stream")]


def _route() -> RoutedRequest:
    return RoutedRequest("POST", "/v1/completions", "", [("Content-Type", "application/json")], b"{}")


async def _relayed(tmp_path: Path, pieces: list[bytes], stream: bool) -> list[Any]:
    """What `EngineReplica.forward` yields for a response whose body is written in `pieces` (a pause between
    each, so each arrives on its own)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=dict(SSE) if stream else {"Content-Type": "application/json"})
        await resp.prepare(request)
        for piece in pieces:
            await resp.write(piece)
            await asyncio.sleep(0.02)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    path = str(tmp_path / "relay.sock")
    await web.UnixSite(runner, path).start()
    replica = object.__new__(EngineReplica)  # the relay needs only the session and the id
    replica.replica_id = "r1"
    replica.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path), auto_decompress=False)
    try:
        return [item async for item in replica.forward(_route())]
    finally:
        await replica.session.close()
        await runner.cleanup()


def test_a_replica_yields_the_head_with_the_first_event_and_whole_events_after(tmp_path: Path) -> None:
    pieces = [b'data: {"a"', b": 1}\n\n", b'data: {"b": 2}\n\ndata: {"c"', b": 3}\n\ndata: [DO", b"NE]\n\n"]
    head, *rest = asyncio.run(_relayed(tmp_path, pieces, stream=True))
    assert isinstance(head, ResponseHead) and head.status == 200
    assert ("x-tinypaged-replica", "r1") in head.headers
    assert head.body == b'data: {"a": 1}\n\n'  # the first event, whole, with the head
    assert rest == [b'data: {"b": 2}\n\n', b'data: {"c": 3}\n\n', b"data: [DONE]\n\n"]


def test_a_replica_relays_a_json_body_as_it_comes(tmp_path: Path) -> None:
    head, *rest = asyncio.run(_relayed(tmp_path, [b'{"x": ', b"1}"], stream=False))
    assert head.body + b"".join(rest) == b'{"x": 1}' and head.body


class _Replica:
    """A replica's answer: `items`, then (when it dies) the error a dead actor's stream raises."""

    def __init__(self, items: list[Any], dies: bool = True) -> None:
        self.items, self.dies = items, dies

    async def stream(self) -> AsyncGenerator[Any, None]:
        for item in self.items:
            yield item
        if self.dies:
            raise RayActorError()


class _Handle:
    """A deployment handle whose n-th call goes to the n-th replica given."""

    def __init__(self, replicas: list[_Replica]) -> None:
        self.replicas = replicas
        self.calls = 0

    def options(self, stream: bool) -> _Handle:
        assert stream
        return self

    @property
    def forward(self) -> _Handle:
        return self

    def remote(self, route: RoutedRequest) -> AsyncGenerator[Any, None]:
        self.calls += 1
        return self.replicas[self.calls - 1].stream()


def _ingress(handle: _Handle) -> Ingress:
    ingress = object.__new__(Ingress)  # the relay needs only the handle
    ingress.engine = handle
    return ingress


async def _sent(handle: _Handle) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await _ingress(handle)._relay(_route(), send)
    return messages


def _body(messages: list[dict[str, Any]]) -> bytes:
    assert messages[-1]["more_body"] is False  # the response ended
    return b"".join(m.get("body", b"") for m in messages)


def test_a_replica_dead_before_its_first_item_fails_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingress_module, "_RETRY_PAUSE_S", 0.0)
    first, done = b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"
    handle = _Handle([_Replica([]), _Replica([ResponseHead(200, SSE, first), done], dies=False)])
    messages = asyncio.run(_sent(handle))
    assert handle.calls == 2
    assert messages[0]["status"] == 200
    assert _body(messages) == first + done


def test_a_stream_cut_mid_way_ends_with_the_error_event_after_its_whole_events() -> None:
    first, second = b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\n'
    handle = _Handle([_Replica([ResponseHead(200, SSE, first), second])])
    messages = asyncio.run(_sent(handle))
    assert handle.calls == 1  # begun: the client has bytes of it, so no other replica is tried
    body = _body(messages)
    assert body.startswith(first + second)
    events = [e for e in body.split(b"\n\n") if e]
    error = json.loads(events[-2].removeprefix(b"data: "))
    assert error["error"]["code"] == "replica_unavailable" and events[-1] == b"data: [DONE]"


def test_every_replica_dead_is_a_503(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingress_module, "_RETRY_PAUSE_S", 0.0)
    handle = _Handle([_Replica([]) for _ in range(ingress_module.ATTEMPTS)])
    messages = asyncio.run(_sent(handle))
    assert handle.calls == ingress_module.ATTEMPTS and messages[0]["status"] == 503
    assert json.loads(_body(messages))["error"]["code"] == "replica_unavailable"
