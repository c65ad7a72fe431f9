"""The HTTP API's error: a status and OpenAI's error object (app.py answers it as JSON), and what the engine's
errors become as one."""

from __future__ import annotations

from tinypaged.errors import EngineDeadError, RequestError
from tinypaged.server import protocol as p


class APIError(Exception):
    """An error response: HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers or {}
        self.info = p.ErrorInfo(message=message, type=type, param=param, code=code)


def internal_error(request_id: str, reason: str) -> APIError:
    """A failure inside the engine, as the client sees it: the request's id, never the fault's text."""
    return APIError(
        500,
        f"The server failed to complete request {request_id}: {reason}. It was logged; please retry.",
        type="server_error",
        code="internal_error",
    )


def engine_unavailable(e: EngineDeadError) -> APIError:
    """The engine has stopped (e.g. a tensor-parallel worker died): 503 until it is restarted."""
    return APIError(
        503, f"The server cannot serve requests: {e}.", type="server_error", code="engine_unavailable"
    )


def request_error(e: RequestError, prompt_param: str = "prompt") -> APIError:
    """The engine's verdict on a request as a 400 with its param and code; the engine's "prompt" is named as
    the endpoint names it (chat: "messages")."""
    param = prompt_param if e.param == "prompt" else e.param
    return APIError(400, str(e), param=param, code=e.code)
