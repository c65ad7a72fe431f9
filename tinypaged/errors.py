"""The engine's errors, shared by every client (the offline LLM, the CLI, the HTTP server); no torch here."""

from __future__ import annotations


class ConfigError(ValueError):
    """A model directory or an engine argument that cannot be used; the message says why."""


class RequestError(ValueError):
    """A request the engine will not run as given: the message says why, `param` names the offending
    parameter (as the OpenAI API spells it), `code` is a machine-readable reason when there is one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class EngineError(RuntimeError):
    """A request failed inside the engine (not because of its input); the message says why."""


class EngineDeadError(EngineError):
    """The engine cannot run any more steps (e.g. a tensor-parallel worker died or hung): every request fails,
    and so will every new one until the engine is restarted. The message names the cause."""
