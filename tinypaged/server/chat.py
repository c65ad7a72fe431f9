"""`POST /v1/chat/completions`: messages through the chat template, chat logprobs, SSE streaming."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tinypaged.server import formatting as fmt
from tinypaged.server import protocol as p
from tinypaged.server.responses import ChoiceDelta, respond
from tinypaged.server.serving import APIError, OpenAIServing, TokenizedPrompt
from tinypaged.tokenizer import Tokenizer


@dataclass
class ChatFormat:
    """The chat wire format: a role-only first chunk per choice, then content deltas; chat logprobs."""

    id: str
    model: str
    top_logprobs: int | None  # None: no logprobs
    tokenizer: Tokenizer
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, d: ChoiceDelta) -> p.ChatChunkChoice:
        """OpenAI's first chunk of a choice carries only the role."""
        return p.ChatChunkChoice(index=d.index, delta=p.DeltaMessage(role="assistant", content=""))

    def delta(self, d: ChoiceDelta) -> p.ChatChunkChoice | None:
        """The content the choice gained; None when there is nothing to send."""
        if not (d.text or d.token_ids or d.finish_reason is not None):
            return None
        return p.ChatChunkChoice(
            index=d.index,
            delta=p.DeltaMessage(content=d.text),
            logprobs=self._logprobs(d),
            finish_reason=d.finish_reason,
            stop_reason=d.stop_reason,
        )

    def choice(self, d: ChoiceDelta) -> p.ChatChoice:
        """The assistant's whole message."""
        return p.ChatChoice(
            index=d.index,
            message=p.ChatResponseMessage(content=d.text),
            logprobs=self._logprobs(d),
            finish_reason=d.finish_reason,
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

    def _logprobs(self, d: ChoiceDelta) -> p.ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        return fmt.chat_logprobs(d.token_ids, d.logprobs, self.top_logprobs, self.tokenizer)


async def create_chat_completion(
    serving: OpenAIServing, req: p.ChatCompletionRequest
) -> msgspec.Struct | AsyncGenerator[bytes, None]:
    """`/v1/chat/completions`: the whole response, or its SSE events when `stream`."""
    serving.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    text = await serving.render_chat(req.messages, req.add_generation_prompt)
    prompt = TokenizedPrompt(text, await serving.encode(text, False, "messages"))
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = serving.sampling_params(req, serving.max_tokens(len(prompt.ids), requested, None), top)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    formatter = ChatFormat(rid, serving.model_name, top, serving.tokenizer)
    outputs = serving.generate(rid, [prompt], [params], prompt_param="messages")
    return await respond(outputs, req, [params], formatter)
