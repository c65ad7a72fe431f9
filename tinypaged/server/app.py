"""The aiohttp application: routes, API key and error middleware, SSE streaming, graceful shutdown."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import signal
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from tinypaged import __version__
from tinypaged.engine.frontend.client import EngineClient
from tinypaged.errors import EngineError
from tinypaged.server import protocol as p
from tinypaged.server.body import codings, decode_json, inflate, prefix
from tinypaged.server.chat import create_chat_completion
from tinypaged.server.completions import create_completion
from tinypaged.server.kv_view import kv_cache_view
from tinypaged.server.metrics import CONTENT_TYPE, ServerMetrics
from tinypaged.server.page import PAGE_PATHS, page_routes
from tinypaged.server.responses import SSE_DONE, sse
from tinypaged.server.serving import APIError, OpenAIServing, model_path

logger = logging.getLogger(__name__)

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Paths open without the API key: probes and scrapes, as vLLM leaves them.
# The playground page too: it holds no secret (its API calls carry the key its user types).
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json"}) | PAGE_PATHS
# Paths that queue work on the engine: refused while the server drains.
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

_encoder = msgspec.json.Encoder()
_LARGE_BODY = 256 * 1024  # bytes: a body this large is inflated and decoded in a thread
_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]*)`")


def _error_param(message: str) -> str | None:
    """The parameter a msgspec validation error is about (`messages[0].content`), from its message."""
    at, missing = _AT.search(message), _MISSING.search(message)
    path = at.group(1) if at else ""
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side: where to listen and the limits on what clients may ask."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the model directory's name
    max_queue_len: int | None = None  # None: unbounded
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    # Seconds a connection may stay without a complete request's headers (sending nothing, or half a header),
    # or idle between requests, before the server closes it; and seconds a request's body may take to arrive
    # (408 after).
    idle_timeout: float = 75.0
    # Listen on this Unix socket instead of host:port (a Ray Serve replica: its ingress is the only client).
    unix_socket: str | None = None


SERVING: web.AppKey[OpenAIServing] = web.AppKey("serving", OpenAIServing)
ENGINE: web.AppKey[EngineClient] = web.AppKey("engine", EngineClient)
CONFIG: web.AppKey[ServerConfig] = web.AppKey("config", ServerConfig)
DRAINING: web.AppKey[asyncio.Event] = web.AppKey("draining", asyncio.Event)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A response whose body is `obj` encoded by msgspec."""
    return web.Response(
        body=_encoder.encode(obj), status=status, headers=headers, content_type="application/json"
    )


def error_response(e: APIError) -> web.Response:
    """OpenAI's error JSON with the error's status and headers (`Connection: close` closes the connection)."""
    response = json_response(p.ErrorResponse(error=e.info), e.status, e.headers)
    if e.headers and e.headers.get("Connection") == "close":
        response.force_close()
    return response


async def _decode(request: web.Request, cls: type[T]) -> T:
    """The body as a `cls` Struct; 413 over the size limit (on the wire or inflated), 415 for a content coding
    this server does not decode, 400 for bad JSON, JSON nested too deeply or a bad field (in `param`)."""
    limit = request.app[CONFIG].max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise APIError(
            413,
            f"The request body has {request.content_length} bytes, more than the limit of {limit}.",
            code="request_too_large",
        )
    names = codings(request.headers.get("Content-Encoding", ""))
    timeout = request.app[CONFIG].idle_timeout
    try:
        async with asyncio.timeout(timeout):  # a body trickled in (or never sent) holds nothing for long
            body = await request.read()  # as sent: aiohttp inflates nothing (start_server)
    except TimeoutError as e:
        raise APIError(
            408, f"The request body did not arrive within {timeout:g} s.", code="request_timeout"
        ) from e
    except web.HTTPException:
        raise  # 413 from aiohttp's own size check (chunked bodies)
    except web.RequestPayloadError as e:  # e.g. a chunked body that does not parse
        # Nothing more is read: the connection closes after the 400 (error_middleware).
        raise APIError(400, "The body could not be read.", code="invalid_body") from e

    def parse() -> T:
        return decode_json(inflate(body, names, limit), cls, _error_param)

    # Inflating (zlib and brotli release the GIL) and scanning a large body run in a thread: the event loop
    # keeps serving meanwhile.
    if names or len(body) > _LARGE_BODY:
        return await asyncio.to_thread(parse)
    return parse()


def unexpected_error(request: web.Request) -> APIError:
    """A bug met while serving: logged with an id the client is given, never its text or traceback."""
    error_id = uuid.uuid4().hex[:12]
    logger.exception("error %s serving %s %s", error_id, request.method, request.path)
    return APIError(
        500,
        f"Internal server error (id {error_id}); it was logged.",
        type="server_error",
        code="internal_error",
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as OpenAI's error JSON; unexpected ones logged and answered 500. A request whose body was
    not read to its end (refused before it: a wrong key, an unknown route, a body past the limit) has its
    connection closed after the answer, the rest of the body neither read nor inflated."""
    response = await _answer(request, handler)
    if request.body_exists and not request.content.is_eof():
        response.force_close()
    return response


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        messages = {
            404: f"No route {request.method} {prefix(request.path)}",
            405: f"Method {request.method} is not allowed on {prefix(request.path)}",
            413: f"The request body is larger than the limit: {e.text}",
        }
        return error_response(APIError(e.status, messages.get(e.status, e.text or e.reason)))
    except asyncio.CancelledError:
        raise
    except Exception:
        return error_response(unexpected_error(request))


def authorized(header: str, key: str) -> bool:
    """Whether an `Authorization` header carries `key` as a Bearer token (RFC 7235: the scheme is
    case-insensitive). Any header is compared, never decoded: aiohttp hands bytes that are not UTF-8 over as
    surrogates, which go back to the same bytes here."""
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), key.encode())


@web.middleware
async def gate_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """401 without the right Bearer key (when one is set), before the body is read; 503 for new generations
    while draining."""
    key = request.app[CONFIG].api_key
    if key is not None and request.path not in PUBLIC_PATHS:
        if not authorized(request.headers.get("Authorization", ""), key):
            raise APIError(
                401, "Missing or invalid API key: send `Authorization: Bearer <key>`.", code="invalid_api_key"
            )
    if request.path in GENERATE_PATHS and request.app[DRAINING].is_set():
        raise APIError(
            503,
            "The server is shutting down.",
            type="server_error",
            code="shutting_down",
            headers={"Retry-After": "5"},
        )
    return await handler(request)


async def _respond(
    request: web.Request, result: msgspec.Struct | AsyncGenerator[bytes, None]
) -> web.StreamResponse:
    """A Struct as JSON, or an SSE stream; its headers go out with the first event (after the first step)."""
    if not isinstance(result, AsyncGenerator):
        return json_response(result)
    events = result
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        await resp.write(first)
        async for event in events:
            await resp.write(event)
    except ConnectionError:
        logger.info("client gone mid-stream: %s %s", request.method, request.path)
        return resp
    except APIError as e:
        await resp.write(sse(p.ErrorResponse(error=e.info)) + SSE_DONE)
    except Exception:  # headers are out: the error goes in the stream, as vLLM sends it
        error = unexpected_error(request)
        await resp.write(sse(p.ErrorResponse(error=error.info)) + SSE_DONE)
    finally:
        await events.aclose()
    await resp.write_eof()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    req = await _decode(request, p.CompletionRequest)
    return await _respond(request, await create_completion(request.app[SERVING], req))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    req = await _decode(request, p.ChatCompletionRequest)
    return await _respond(request, await create_chat_completion(request.app[SERVING], req))


async def tokenize(request: web.Request) -> web.StreamResponse:
    """POST /tokenize."""
    return json_response(await request.app[SERVING].tokenize(await _decode(request, p.TokenizeRequest)))


async def detokenize(request: web.Request) -> web.StreamResponse:
    """POST /detokenize."""
    req = await _decode(request, p.DetokenizeRequest)
    return json_response(await request.app[SERVING].detokenize(req))


async def models(request: web.Request) -> web.StreamResponse:
    """GET /v1/models."""
    return json_response(request.app[SERVING].models())


async def health(request: web.Request) -> web.StreamResponse:
    """GET /health: 200 while the engine serves and the server is not draining; 503 naming why not (the
    engine dead, or stalled: no step for the stall timeout)."""
    why = "the server is shutting down" if request.app[DRAINING].is_set() else request.app[ENGINE].unavailable
    if why is not None:
        return json_response({"status": "unavailable", "message": why}, 503)
    return json_response({"status": "ok"})


async def version(request: web.Request) -> web.StreamResponse:
    """GET /version."""
    return json_response(p.VersionResponse(version=__version__))


async def metrics(request: web.Request) -> web.StreamResponse:
    """GET /metrics in the Prometheus text format."""
    engine = request.app[ENGINE]
    text = request.app[SERVING].metrics.render(engine.stats(), engine.core_pid, engine.unavailable)
    return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})


async def kv_cache(request: web.Request) -> web.StreamResponse:
    """GET /kv-cache: the KV cache's blocks between two steps (`server/kv_view.py` has the format)."""
    try:
        snap = await request.app[ENGINE].snapshot()
    except EngineError as e:
        raise APIError(503, str(e), type="server_error") from e
    return json_response(kv_cache_view(snap))


async def openapi(request: web.Request) -> web.StreamResponse:
    """GET /openapi.json."""
    return json_response(p.openapi_schema(__version__))


def build_app(engine: EngineClient, config: ServerConfig) -> web.Application:
    """The application over a built (not necessarily started) engine; it starts and stops the engine."""
    name = config.served_model_name or model_path(engine.config).name
    # aiohttp's own limit backs up the Content-Length check for chunked bodies (it answers 413 too).
    app = web.Application(
        middlewares=[error_middleware, gate_middleware], client_max_size=config.max_body_bytes
    )
    app[ENGINE] = engine
    app[CONFIG] = config
    ec = engine.config
    server_metrics = ServerMetrics(
        name,
        {
            "block_size": str(ec.block_size),
            "cache_dtype": ec.kv_cache_dtype,
            "enable_prefix_caching": str(ec.enable_prefix_caching),
            "quantization": str(ec.quantization),
        },
    )
    engine.add_step_listener(server_metrics.observe_step)
    app[SERVING] = OpenAIServing(engine, name, server_metrics, config.max_queue_len)
    app[DRAINING] = asyncio.Event()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/kv-cache", kv_cache)
    app.router.add_routes(page_routes())

    async def start_engine(app: web.Application) -> None:
        await engine.start()

    async def stop_engine(app: web.Application) -> None:
        await engine.shutdown()

    app.on_startup.append(start_engine)
    app.on_cleanup.append(stop_engine)
    return app


class _Connection(web.RequestHandler):
    """aiohttp's handler of one connection, but for a request its HTTP parser refuses (a malformed request line,
    header or chunked body): aiohttp answers those before any middleware sees them, quoting the offending bytes
    (up to a whole ~128 KB chunk of an unauthenticated body) in a plain-text 400 and in an error-level log
    record with a traceback. Here the answer is OpenAI's error JSON and the log one info line, each quoting at
    most a short prefix. aiohttp has no supported hook for this (aio-libs/aiohttp#3287); `handle_error` is
    the method its connections call for it, and every other error keeps aiohttp's handling."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """OpenAI's error JSON for a request the HTTP parser refused; aiohttp's answer for anything else."""
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        reason = prefix(" ".join(exc.message.split()))  # one line
        logger.info("malformed HTTP request from %s refused (%d): %s", request.remote, status, reason)
        info = p.ErrorInfo(message=f"Malformed HTTP request: {reason}", type="invalid_request_error")
        response = json_response(p.ErrorResponse(error=info), status)
        response.force_close()
        return response


class _Server(web.Server):
    """aiohttp's low-level server, whose connections are `_Connection`s."""

    def __call__(self) -> web.RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)


async def start_server(engine: EngineClient, config: ServerConfig) -> tuple[web.AppRunner, str]:
    """Build the app, start the engine and listen; returns the runner and the base URL (port 0: any free;
    `unix:PATH` on a Unix socket)."""
    app = build_app(engine, config)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    # keepalive_timeout: aiohttp starts it when a connection opens and again after each response, so it closes
    # a connection that never completes a request's headers as well as an idle one.
    # auto_decompress off: aiohttp would inflate a compressed body as it arrives, before any handler decides to
    # read it, and drain (inflating) what is left after the answer, with no limit on the inflated size; here a
    # body is inflated only once its request is authenticated and only up to the body limit (_decode).
    # lingering_time 0: a body not read to its end (a refused request's) is not drained after the answer
    # either; the connection is closed.
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=config.shutdown_timeout,
        keepalive_timeout=config.idle_timeout,
        access_log=logging.getLogger("aiohttp.access"),
        auto_decompress=False,
        lingering_time=0,
    )
    await runner.setup()
    assert type(runner.server) is web.Server  # the class swapped below: the same object, its connections ours
    runner.server.__class__ = _Server
    if config.unix_socket is not None:
        await web.UnixSite(runner, config.unix_socket).start()
        return runner, f"unix:{config.unix_socket}"
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def stop_server(runner: web.AppRunner) -> None:
    """Drain: refuse new generations, stop listening, give in-flight ones shutdown_timeout, then cancel."""
    runner.app[DRAINING].set()
    await runner.cleanup()


async def run_server(engine_factory: Callable[[], EngineClient], config: ServerConfig) -> None:
    """Load the model, serve until SIGTERM or SIGINT, then shut down gracefully."""
    engine = engine_factory()
    runner, url = await start_server(engine, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    phases = ", ".join(f"{name} {s:.1f} s" for name, s in engine.stats().startup)
    started = f" (startup: {phases})" if phases else ""
    print(f"tinypaged {__version__} serving {runner.app[SERVING].model_name} on {url}{started}", flush=True)
    await stop.wait()
    logger.warning("shutting down: waiting up to %.0f s for in-flight requests", config.shutdown_timeout)
    await stop_server(runner)


def serve(engine_factory: Callable[[], EngineClient], config: ServerConfig) -> int:
    """Run the server on uvloop until it is told to stop; 0 on a clean shutdown."""
    import uvloop

    uvloop.run(run_server(engine_factory, config))
    return 0
