"""Tool calls in chat: the grammar that makes a model call a tool (`tool_choice` "required" or a named function),
and the parsing of its calls out of the generated text, as it streams.

- `tool_choice: {"type": "function", "function": {"name": F}}`: the output is F's arguments, constrained by F's
  parameter schema; it streams as the arguments of one call.
- `"required"`: the output is a JSON array of `{"name": ..., "parameters": {...}}`, each element constrained
  by its function's schema (at most one element when `parallel_tool_calls` is false); a call is sent as soon
  as its element is complete.
- `"auto"` (the default when tools are given): the model writes what it wants; calls in the formats open-weight
  models are trained on are found in it: Hermes' `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
  blocks (Qwen's; the text around them is content), a Llama 3.x reply that is nothing but JSON calls,
  `{"name": ..., "parameters": ...}` (several separated by `;`), or a Mistral reply of calls after
  `[TOOL_CALLS]`: a JSON array of `{"name": ..., "arguments": ...}` (tokenizer v3; the array alone where the
  marker, a special token, was skipped in decoding) or `name[ARGS]{...}` each (v11). Text that may still turn
  into a call is held back from the stream until it is known.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from tinypaged.errors import RequestError
from tinypaged.sampling_params import StructuredOutputsParams
from tinypaged.server.errors import APIError
from tinypaged.server.messages import FunctionDefinition, NamedToolChoice, Tool, ToolChoice

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class Call:
    """One tool call found in the output: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> str:
    """The tool mode: "none", "auto", "required" or "named" (400s for choices that name what is not there,
    and for a function whose parameter schema is past the limits a `response_format` schema is held to)."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return "none"
    for i, t in enumerate(tools):
        if t.function.parameters is not None:
            _check_schema(t.function.parameters, f"tools[{i}].function.parameters")
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return choice
    if not any(t.function.name == choice.function.name for t in tools):
        raise APIError(
            400,
            f"tool_choice names the function {choice.function.name!r}, which is not in tools",
            param="tool_choice",
        )
    return "named"


def _check_schema(schema: dict[str, Any], param: str) -> None:
    """A tool's parameter schema under StructuredOutputsParams' own checks (its size), whatever the tool mode;
    its nesting was bounded with the body (limits.MAX_JSON_DEPTH), and the engine's compile checks it as it
    checks a `response_format` schema when the mode makes it a constraint."""
    try:
        StructuredOutputsParams(json=schema)
    except RequestError as e:
        raise APIError(400, f"{param}: {e}", param=param) from e


def tool_grammar(
    tools: list[Tool], mode: str, choice: ToolChoice | None, parallel: bool
) -> tuple[StructuredOutputsParams, str] | None:
    """The constraint a tool mode puts on the output, with the request parameter it comes from (None for
    "auto" and "none": the model writes freely); 400 naming `tools` for a "required" constraint past the
    limits together."""
    if mode == "named":
        assert isinstance(choice, NamedToolChoice)
        i, fn = next((i, t.function) for i, t in enumerate(tools) if t.function.name == choice.function.name)
        return StructuredOutputsParams(json=_parameters(fn)), f"tools[{i}].function.parameters"
    if mode != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t.function)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    try:
        return StructuredOutputsParams(json=schema), "tools"
    except RequestError as e:
        raise APIError(400, f'tool_choice "required" over all the tools: {e}', param="tools") from e


def _parameters(fn: FunctionDefinition) -> dict[str, Any]:
    """A function's parameter schema; none means it takes no arguments (OpenAI's reading)."""
    return fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}


class CallParser:
    """Finds the calls in one choice's text as it grows (`feed`, then `finish`): each call once it is
    complete, and the content around them, never sending text that may still be part of a call."""

    def __init__(self, mode: str) -> None:
        self.mode = mode  # "auto" or "required"
        self.text = ""
        self.pos = 0  # text before it is sent (as content) or parsed (as calls)
        self.calls: list[Call] = []
        self.inside = False  # auto: within a Hermes <tool_call> block

    def feed(self, delta: str) -> tuple[str, list[Call]]:
        """Content that can be sent now, and the calls completed by `delta`."""
        self.text += delta
        return self._scan(final=False)

    def finish(self) -> tuple[str, list[Call]]:
        """At the end: whatever is left, as calls when it parses as calls, else as content."""
        return self._scan(final=True)

    def _scan(self, final: bool) -> tuple[str, list[Call]]:
        if self.mode == "required":
            return "", self._json_array(final)
        if self.pos == 0 and not self.calls and not self.inside:
            opening = self.text.lstrip()
            if not opening and not final:
                return "", []  # nothing but whitespace yet: content or a call, it is too early to say
            if opening.startswith("{"):
                return self._llama_json(final)
            if opening.startswith((MISTRAL_CALLS, "[{")):
                return self._mistral(final)
            if not final and MISTRAL_CALLS.startswith(opening):
                return "", []  # "[", "[TOOL": a Mistral call may be forming
        content, calls = "", []
        while True:
            rest = self.text[self.pos :]
            if self.inside:
                end = rest.find(HERMES_CLOSE)
                if end < 0:
                    if final:  # an unclosed block: a call if what is there parses, else content
                        call = _call_of(rest)
                        calls += [call] if call else []
                        content += "" if call else HERMES_OPEN + rest
                        self.pos = len(self.text)
                    break
                call = _call_of(rest[:end])
                calls += [call] if call else []
                content += "" if call else HERMES_OPEN + rest[: end + len(HERMES_CLOSE)]
                self.pos += end + len(HERMES_CLOSE)
                self.inside = False
                continue
            start = rest.find(HERMES_OPEN)
            if start >= 0:
                content += self._content(rest[:start], calls)
                self.pos += start + len(HERMES_OPEN)
                self.inside = True
                continue
            keep = 0 if final else _partial_suffix(rest, HERMES_OPEN)
            content += self._content(rest[: len(rest) - keep], calls)
            self.pos += len(rest) - keep
            break
        self.calls += calls
        return content, calls

    def _content(self, text: str, new_calls: list[Call]) -> str:
        """Text outside the blocks; only whitespace after a call is not content (it separates calls)."""
        return "" if (self.calls or new_calls) and not text.strip() else text

    def _llama_json(self, final: bool) -> tuple[str, list[Call]]:
        """A reply that opens with JSON is held until the end, then read as `;`-separated calls."""
        if not final:
            return "", []
        rest = self.text[self.pos :]
        calls = []
        for part in _split_json(rest):
            call = _call_of(part)
            if call is None:
                self.pos = len(self.text)
                return rest, []  # not calls after all: all of it is content
            calls.append(call)
        self.pos = len(self.text)
        self.calls += calls
        return "", calls

    def _mistral(self, final: bool) -> tuple[str, list[Call]]:
        """A reply that opens with `[TOOL_CALLS]` (or a JSON array) is held until the end, then read as calls:
        each part after a marker is a JSON array of calls or `name[ARGS]{...}`; if any is not, all is content."""
        if not final:
            return "", []
        rest = self.text[self.pos :]
        self.pos = len(self.text)
        calls = []
        for part in rest.strip().split(MISTRAL_CALLS):
            part = part.strip()
            if not part:
                continue
            if part.startswith("["):
                try:  # the model's text: JSON nested past Python's stack is no call either
                    items = json.loads(part)
                except (ValueError, RecursionError):
                    return rest, []
                found = [_call_of(json.dumps(x)) for x in items] if isinstance(items, list) else [None]
            else:
                name, sep, args = part.partition(MISTRAL_ARGS)
                ok = sep and _is_json(args)
                found = (
                    [_call_of(json.dumps({"name": name.strip(), "arguments": args.strip()}))]
                    if ok
                    else [None]
                )
            if None in found:
                return rest, []
            calls += found
        if not calls:
            return rest, []
        self.calls += calls
        return "", calls

    def _json_array(self, final: bool) -> list[Call]:
        """ "required": the elements of the constrained array, each sent once complete."""
        calls = []
        text = self.text
        while True:
            i = self.pos
            while i < len(text) and text[i] in " \t\n\r[,":
                i += 1
            if i >= len(text) or text[i] != "{":
                break
            try:  # the model's text: JSON nested past Python's stack ends the calls
                obj, end = _decoder.raw_decode(text, i)
                arguments = (
                    json.dumps(obj.get("parameters", {}), ensure_ascii=False) if isinstance(obj, dict) else ""
                )
            except (ValueError, RecursionError):
                break
            self.pos = end
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                calls.append(Call(obj["name"], arguments))
        self.calls += calls
        return calls


def _call_of(text: str) -> Call | None:
    """A call from `{"name": ..., "arguments" | "parameters": {...}}`, or None."""
    try:  # the model's text: JSON nested past Python's stack is no call either
        obj = json.loads(text.strip())
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return Call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
    except (ValueError, RecursionError):
        return None


def _is_json(text: str) -> bool:
    try:  # the model's text: JSON nested past Python's stack is not JSON here
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _split_json(text: str) -> list[str]:
    """Llama 3.x's calls: JSON objects separated by `;` (or whitespace)."""
    parts, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\n\r;":
            i += 1
        if i >= len(text):
            return parts
        try:
            _, end = _decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            return parts + [text[i:]]  # not JSON: the caller reads it as content
        parts.append(text[i:end])
        i = end


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back: the marker may be forming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
