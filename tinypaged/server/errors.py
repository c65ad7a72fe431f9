"""The HTTP API's error: a status and OpenAI's error object (app.py answers it as JSON)."""

from __future__ import annotations

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
