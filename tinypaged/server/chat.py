"""`POST /v1/chat/completions`: messages (and tools) through the chat template, structured outputs, tool calls,
chat logprobs, SSE streaming."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tinypaged.server import formatting as fmt
from tinypaged.server import protocol as p
from tinypaged.server.messages import FunctionCall, NamedToolChoice, ToolCall
from tinypaged.server.responses import ChoiceDelta, respond
from tinypaged.server.serving import APIError, OpenAIServing, TokenizedPrompt
from tinypaged.server.tools import Call, CallParser, check_tools, tool_grammar
from tinypaged.tokenizer import Tokenizer


@dataclass
class ChatFormat:
    """The chat wire format: a role-only first chunk per choice, then content and tool-call deltas; chat
    logprobs. `tool_mode` (server/tools.py): "none" (plain content), "named" (the output is the named function's
    arguments), "auto" or "required" (calls parsed out of the output as it grows)."""

    id: str
    model: str
    top_logprobs: int | None  # None: no logprobs
    tokenizer: Tokenizer
    tool_mode: str = "none"
    tool_name: str | None = None  # the named function
    created: int = field(default_factory=lambda: int(time.time()))
    _parsers: dict[int, CallParser] = field(default_factory=dict)  # by choice (streams)
    _call_ids: dict[int, str] = field(default_factory=dict)  # by choice: the named call's id, once sent

    def head(self, d: ChoiceDelta) -> p.ChatChunkChoice:
        """OpenAI's first chunk of a choice carries only the role."""
        return p.ChatChunkChoice(index=d.index, delta=p.DeltaMessage(role="assistant", content=""))

    def delta(self, d: ChoiceDelta) -> p.ChatChunkChoice | None:
        """The content and tool calls the choice gained; None when there is nothing to send."""
        if self.tool_mode == "none":
            content, calls = d.text, None
        elif self.tool_mode == "named":
            content, calls = None, self._named_delta(d)
        else:
            parser = self._parsers.setdefault(d.index, CallParser(self.tool_mode))
            sent = len(parser.calls)
            content, found = parser.feed(d.text)
            if d.finish_reason is not None:
                rest, more = parser.finish()
                content, found = content + rest, found + more
            calls = [_call_delta(sent + k, c) for k, c in enumerate(found)] or None
            content = content or None
        if not (content or calls or d.token_ids or d.finish_reason is not None):
            return None
        return p.ChatChunkChoice(
            index=d.index,
            delta=p.DeltaMessage(content=content, tool_calls=calls),
            logprobs=self._logprobs(d),
            finish_reason=self._finish_reason(d, self._parsers.get(d.index)),
            stop_reason=d.stop_reason,
        )

    def choice(self, d: ChoiceDelta) -> p.ChatChoice:
        """The assistant's whole message."""
        content: str | None = d.text
        calls: list[Call] = []
        parser = None
        if self.tool_mode == "named":
            assert self.tool_name is not None
            content, calls = None, [Call(self.tool_name, d.text)]
        elif self.tool_mode != "none":
            parser = CallParser(self.tool_mode)
            head, calls = parser.feed(d.text)
            rest, more = parser.finish()
            content, calls = (head + rest) or None, calls + more
        tool_calls = [ToolCall(id=c.id, function=FunctionCall(c.name, c.arguments)) for c in calls]
        return p.ChatChoice(
            index=d.index,
            message=p.ChatResponseMessage(content=content, tool_calls=tool_calls),
            logprobs=self._logprobs(d),
            finish_reason=self._finish_reason(d, parser),
            stop_reason=d.stop_reason,
        )

    def chunk(self, choices: list[Any], usage: p.UsageInfo | None = None) -> p.ChatCompletionChunk:
        """A streamed chunk (usage only in the last, when asked for)."""
        return p.ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def response(self, choices: list[Any], usage: p.UsageInfo) -> p.ChatCompletionResponse:
        """The whole chat completion."""
        return p.ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _named_delta(self, d: ChoiceDelta) -> list[p.DeltaToolCall] | None:
        """The named call's arguments as they grow; its id, type and name with the first piece."""
        if d.index not in self._call_ids:
            if not d.text:
                return None
            call = Call(self.tool_name or "", d.text)
            self._call_ids[d.index] = call.id
            return [_call_delta(0, call)]
        if not d.text:
            return None
        return [p.DeltaToolCall(index=0, function=p.DeltaFunctionCall(arguments=d.text))]

    def _finish_reason(self, d: ChoiceDelta, parser: CallParser | None) -> str | None:
        """ "tool_calls" when a finished output made calls of its own accord (auto) or was made to (required);
        a named function's call finishes as OpenAI's does, with the output's own reason."""
        if d.finish_reason == "stop" and parser is not None and parser.calls:
            return "tool_calls"
        return d.finish_reason

    def _logprobs(self, d: ChoiceDelta) -> p.ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        return fmt.chat_logprobs(d.token_ids, d.logprobs, self.top_logprobs, self.tokenizer)


def _call_delta(index: int, call: Call) -> p.DeltaToolCall:
    """A whole call as a stream sends its first (here: only) delta."""
    return p.DeltaToolCall(
        index=index, id=call.id, type="function", function=p.DeltaFunctionCall(call.name, call.arguments)
    )


async def create_chat_completion(
    serving: OpenAIServing, req: p.ChatCompletionRequest
) -> msgspec.Struct | AsyncGenerator[bytes, None]:
    """`/v1/chat/completions`: the whole response, or its SSE events when `stream`."""
    serving.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    mode = check_tools(req.tools, req.tool_choice)
    tools = [msgspec.to_builtins(t) for t in req.tools] if req.tools else None
    text = await serving.render_chat(req.messages, req.add_generation_prompt, tools)
    prompt = TokenizedPrompt(text, await serving.encode(text, False, "messages"))
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    structured = serving.structured_outputs(req)
    forced = tool_grammar(req.tools or [], mode, req.tool_choice, req.parallel_tool_calls)
    if forced is not None and structured is not None:
        raise APIError(
            400,
            "response_format and structured_outputs cannot be combined with tool_choice required or a named "
            "function",
            param="tool_choice",
        )
    spec, param = forced or structured or (None, "")
    params = serving.sampling_params(
        req, serving.max_tokens(len(prompt.ids), requested, None), top, None, spec
    )
    await serving.compile_grammar(params, param)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
    formatter = ChatFormat(rid, serving.model_name, top, serving.tokenizer, mode, named)
    outputs = serving.generate(rid, [prompt], [params], prompt_param="messages")
    return await respond(outputs, req, [params], formatter)
