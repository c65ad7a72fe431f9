"""`POST /v1/completions`: prompts in every OpenAI form, echo, legacy logprobs, SSE streaming."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tinypaged.limits import MAX_PROMPTS
from tinypaged.server import formatting as fmt
from tinypaged.server import protocol as p
from tinypaged.server.responses import ChoiceDelta, respond
from tinypaged.server.serving import APIError, OpenAIServing, TokenizedPrompt
from tinypaged.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat's is the room left in the context)


async def _completion_prompts(serving: OpenAIServing, prompt: str | list) -> list[TokenizedPrompt]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        prompt = [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
    kinds = {type(x) for x in prompt}
    if len(kinds) > 1:
        raise APIError(
            400,
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token id lists, not a mix",
            param="prompt",
        )
    out = []
    for x in prompt:
        if isinstance(x, str):
            out.append(TokenizedPrompt(x, await serving.encode(x, True, "prompt")))
        else:
            out.append(TokenizedPrompt(None, list(x)))
    return out


@dataclass
class CompletionFormat:
    """The completions wire format: echo in a choice's first chunk, legacy logprobs whose text offsets run on
    across the choice's chunks; a response and its chunks are the same Struct."""

    id: str
    model: str
    req: p.CompletionRequest
    prompts: list[TokenizedPrompt]
    tokenizer: Tokenizer
    created: int = field(default_factory=lambda: int(time.time()))
    offsets: dict[int, int] = field(default_factory=dict)  # by choice: where its next token's text starts

    def head(self, d: ChoiceDelta) -> None:
        """Completions send no head."""
        return None

    def delta(self, d: ChoiceDelta) -> p.CompletionChoice | None:
        """The choice's delta, the prompt before it when echoing; None when there is nothing to send."""
        choice = self.choice(d)
        return choice if choice.text or d.token_ids or d.finish_reason is not None else None

    def choice(self, d: ChoiceDelta) -> p.CompletionChoice:
        """A choice's text and legacy logprobs, the prompt's first in a first delta when echoing."""
        echo = d.first and self.req.echo
        k, logprobs = self.req.logprobs, None
        if k is not None:
            logprobs = p.CompletionLogprobs()
            offset = self.offsets.get(d.index, 0)
            if echo:  # the prompt's logprobs: None for its first token, as vLLM has them
                prompt, prompt_lps = d.request.prompt_token_ids, d.request.prompt_logprobs
                offset = fmt.extend_legacy(logprobs, prompt, prompt_lps, k, self.tokenizer, offset)
            self.offsets[d.index] = fmt.extend_legacy(
                logprobs, d.token_ids, d.logprobs, k, self.tokenizer, offset
            )
        return p.CompletionChoice(
            index=d.index,
            text=(self.prompts[d.prompt_index].text or "") + d.text if echo else d.text,
            logprobs=logprobs,
            finish_reason=d.finish_reason,
            stop_reason=d.stop_reason,
        )

    def chunk(self, choices: list[Any], usage: p.UsageInfo | None = None) -> p.CompletionResponse:
        """A streamed chunk (usage only in the last, when asked for)."""
        return p.CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def response(self, choices: list[Any], usage: p.UsageInfo) -> p.CompletionResponse:
        """The whole completion."""
        return self.chunk(choices, usage)


async def create_completion(
    serving: OpenAIServing, req: p.CompletionRequest
) -> msgspec.Struct | AsyncGenerator[bytes, None]:
    """`/v1/completions`: the whole response, or its SSE events when `stream`."""
    serving.check_model(req.model)
    prompts = await _completion_prompts(serving, req.prompt)
    spec, param = serving.structured_outputs(req) or (None, "")
    params = [
        serving.sampling_params(
            req,
            serving.max_tokens(len(pr.ids), req.max_tokens, DEFAULT_MAX_TOKENS),
            req.logprobs,
            req.logprobs if req.echo else None,
            spec,
        )
        for pr in prompts
    ]
    await serving.compile_grammar(params[0], param)  # one grammar for every prompt
    rid = f"cmpl-{uuid.uuid4().hex}"
    outputs = serving.generate(rid, prompts, params)  # checked here: a prompt too long is refused unread
    for pr in prompts:
        if pr.text is None and req.echo:
            pr.text = serving.tokenizer.decode(pr.ids, False)
    formatter = CompletionFormat(rid, serving.model_name, req, prompts, serving.tokenizer)
    return await respond(outputs, req, params, formatter)
