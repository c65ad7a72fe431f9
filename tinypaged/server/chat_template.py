"""A chat request's messages as chat templates read them: plain dicts of role, text content and tool fields, after
the HTTP API's rules that the schema cannot say (OpenAIServing.render_chat renders them)."""

from __future__ import annotations

from typing import Any

import msgspec

from tinypaged.server.body import loads
from tinypaged.server.errors import APIError
from tinypaged.server.messages import AssistantMessage, ChatMessage, RefusalPart, TextPart


def template_message(m: ChatMessage, where: str) -> dict[str, Any]:
    """One message as chat templates read it: its role, its content as text, and its tool fields when given.
    Here too the HTTP API's rules that the schema cannot say: an assistant message without content must carry
    tool or function calls, and a text-only model serves only text parts (and an assistant's refusals)."""
    role = m.__struct_config__.tag
    content = m.content
    if content is None and isinstance(m, AssistantMessage) and not (m.tool_calls or m.function_call):
        raise APIError(
            400,
            f"{where}: an assistant message needs `content` unless it has `tool_calls` or `function_call`.",
            param=f"{where}.content",
        )
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, TextPart | RefusalPart):
                texts.append(part.text if isinstance(part, TextPart) else part.refusal)
            else:
                raise APIError(
                    400,
                    f"{where}.content[{j}]: `{part.__struct_config__.tag}` parts are not supported; this server "
                    "serves a text-only model.",
                    param=f"{where}.content[{j}].type",
                )
        content = "\n".join(texts)
    out: dict[str, Any] = {"role": role, "content": content or ""}
    for key in ("name", "tool_call_id", "tool_calls", "function_call"):
        value = getattr(m, key, None)
        if value is not None:
            out[key] = msgspec.to_builtins(value)
    for k, call in enumerate(out.get("tool_calls", [])):
        # Templates (Llama 3.1's, Qwen's, ...) write a call's arguments with `tojson`: a mapping, as HF and vLLM
        # hand them; arguments that are not a JSON object stay the string they were.
        try:
            args = loads(call["function"]["arguments"], f"{where}.tool_calls[{k}].function.arguments")
        except ValueError:
            continue
        if isinstance(args, dict):
            call["function"]["arguments"] = args
    return out
