"""The ingress of the Ray Serve application: a raw ASGI app (Ray Serve's HTTP proxy speaks ASGI) that relays each
HTTP request to one engine replica's own server, after keying it for the router.

It implements none of the API: the replica's aiohttp server answers every request (schema, errors, auth, limits,
streaming), so the API has one implementation whether it runs alone or behind Ray. The ingress adds only what
replicas need in front of them:
- the routing key: a generation request's prompt, tokenized as the server tokenizes it, as the chained hashes of
  its full blocks (routing.py), computed only for a request that carries the API key (when one is set), so an
  unauthenticated body is never parsed here;
- failover: a request the replica died before answering (no byte of the response sent: the replica's first item
  holds the head and the first bytes, replica.py) goes to another replica; a stream cut off mid-way ends, after
  its last whole event, with an SSE error event (`replica_unavailable`) and `[DONE]`;
- `/metrics`: every replica's, each sample labelled with its replica (the board, replica.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from ray import exceptions as ray_errors

from tinypaged.config import EngineConfig
from tinypaged.replicas.replica import ResponseHead, is_event_stream
from tinypaged.replicas.routing import PROMPT_PATHS, RoutedRequest, route_key
from tinypaged.server import protocol as p
from tinypaged.server.app import PUBLIC_PATHS, authorized
from tinypaged.server.metrics import CONTENT_TYPE
from tinypaged.server.responses import SSE_DONE, sse
from tinypaged.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ATTEMPTS = 4  # replicas a request not yet answered is offered to (each died before answering) before a 503
_RETRY_PAUSE_S = 0.2  # between attempts: Serve's routers learn of a dead replica meanwhile
_LONG_BODY = 8192  # bytes: a body this long is keyed in a thread, off the event loop
# A replica gone: the actor died, or cannot be reached.
REPLICA_GONE = (ray_errors.RayActorError, ray_errors.ActorUnavailableError)

Send = Any
Receive = Any


def _error(message: str, code: str) -> bytes:
    info = p.ErrorInfo(message=message, type="server_error", code=code)
    return msgspec.json.encode(p.ErrorResponse(error=info))


class Ingress:
    """The HTTP front of the replicas (app.py deploys it with `serve.ingress`)."""

    def __init__(
        self,
        engine: Any,
        board: Any,
        engine_kwargs: dict[str, Any],
        api_key: str | None = None,
        max_body_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        config = EngineConfig(**engine_kwargs)
        self.engine = engine  # the EngineReplica deployment's handle
        self.board = board
        self.tokenizer = Tokenizer(config.tokenizer_path)
        self.block_size = config.block_size
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    def __serve_build_asgi_app__(self) -> Any:
        async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
            await self.asgi(scope, receive, send)

        return app  # a plain coroutine function: how uvicorn tells ASGI 3 from ASGI 2 (a bound method reads as 2)

    async def asgi(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """The ASGI app: lifespan events acknowledged, every HTTP request relayed (or /metrics gathered)."""
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/metrics" and method == "GET":
            text = await self.board.render.remote()
            await _answer(send, 200, text.encode(), CONTENT_TYPE)
            return
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        allowed = self._authorized(path, headers)
        # A request without the key is answered 401 by the replica, as by `tinypaged serve`, before its body
        # is read: it is relayed without it.
        body = await self._body(receive) if allowed else b""
        route = RoutedRequest(method, path, scope["query_string"].decode("latin-1"), headers, body)
        # Ray's PrefixCacheAffinityRouter matches `prompt` text and refuses an empty one.
        route.prompt = f"{method} {path}"
        if method == "POST" and path in PROMPT_PATHS and allowed:
            key = (
                await asyncio.to_thread(route_key, self.tokenizer, self.block_size, path, body)
                if len(body) > _LONG_BODY
                else route_key(self.tokenizer, self.block_size, path, body)
            )
            if key is not None and key[0]:
                route.prompt, route.block_keys = key
        await self._relay(route, send)

    def _authorized(self, path: str, headers: list[tuple[str, str]]) -> bool:
        if self.api_key is None or path in PUBLIC_PATHS:
            return True
        header = next((v for k, v in headers if k.lower() == "authorization"), "")
        return authorized(header, self.api_key)

    async def _body(self, receive: Receive) -> bytes:
        """The request body, read up to one byte past the limit: the replica answers 413 past it."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise asyncio.CancelledError
            chunk = message.get("body", b"")
            if size <= self.max_body_bytes:
                chunks.append(chunk[: self.max_body_bytes + 1 - size])
                size += len(chunks[-1])
            if not message.get("more_body"):
                return b"".join(chunks)

    async def _relay(self, route: RoutedRequest, send: Send) -> None:
        """Send the request to a replica and its response to the client; on a replica's death before its first
        byte, to another one (ATTEMPTS in all)."""
        for attempt in range(ATTEMPTS):
            route.attempt = attempt
            stream = self.engine.options(stream=True).forward.remote(route)
            try:
                head = await stream.__anext__()
                break
            except REPLICA_GONE as e:
                logger.warning(
                    "replica gone before answering %s %s (attempt %d): %s", *_what(route, attempt), e
                )
                await asyncio.sleep(_RETRY_PAUSE_S)
            except Exception:  # a bug met relaying: the server's own 500, its text only in the log
                logger.exception("relaying %s %s", route.method, route.path)
                message = "Internal server error while relaying the request to a replica; it was logged."
                await _answer(send, 500, _error(message, "internal_error"), "application/json")
                return
        else:
            message = f"No replica could answer the request ({ATTEMPTS} tried); retry later."
            await _answer(send, 503, _error(message, "replica_unavailable"), "application/json")
            return
        assert isinstance(head, ResponseHead)
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in head.headers]
        await send({"type": "http.response.start", "status": head.status, "headers": raw})
        await send({"type": "http.response.body", "body": head.body, "more_body": True})
        events = is_event_stream(head.headers)
        try:
            async for chunk in stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except REPLICA_GONE + (ray_errors.RayTaskError,) as e:
            logger.warning("replica gone mid-response to %s %s: %s", route.method, route.path, e)
            if events:
                info = p.ErrorInfo(
                    message="The replica serving this stream stopped before the stream ended; retry the request.",
                    type="server_error",
                    code="replica_unavailable",
                )
                chunk = sse(p.ErrorResponse(error=info)) + SSE_DONE
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _what(route: RoutedRequest, attempt: int) -> tuple[str, str, int]:
    return route.method, route.path, attempt + 1


async def _answer(send: Send, status: int, body: bytes, content_type: str) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
