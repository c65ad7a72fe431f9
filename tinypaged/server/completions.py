"""`POST /v1/completions`: prompts in every OpenAI form, echo, legacy logprobs, SSE streaming."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from tinypaged.outputs import RequestOutput
from tinypaged.server import formatting as fmt
from tinypaged.server import protocol as p
from tinypaged.server.serving import (
    SSE_DONE,
    APIError,
    ChoiceState,
    OpenAIServing,
    TokenizedPrompt,
    advance,
    collect,
    final_only,
    raise_if_failed,
    sse,
    usage_of,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat's is the room left in the context)


async def _completion_prompts(serving: OpenAIServing, prompt: str | list) -> list[TokenizedPrompt]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        prompt = [prompt]
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
            out.append(TokenizedPrompt(x, await serving.encode(x, True)))
        else:
            out.append(TokenizedPrompt(None, list(x)))
    return out


async def create_completion(
    serving: OpenAIServing, req: p.CompletionRequest
) -> p.CompletionResponse | AsyncIterator[bytes]:
    """`/v1/completions`: the whole response, or its SSE events when `stream`."""
    serving.check_model(req.model)
    prompts = await _completion_prompts(serving, req.prompt)
    params = [
        serving.sampling_params(
            req,
            serving.max_tokens(len(pr.ids), req.max_tokens, DEFAULT_MAX_TOKENS),
            req.logprobs,
            req.logprobs if req.echo and req.logprobs is not None else None,
        )
        for pr in prompts
    ]
    serving.check_queue()
    for pr in prompts:
        if pr.text is None and req.echo:
            pr.text = serving.tokenizer.decode(pr.ids, False)
    rid = f"cmpl-{uuid.uuid4().hex}"
    outputs = serving.generate(rid, prompts, params)
    if req.stream:
        return _stream_completion(serving, rid, req, prompts, outputs, final_only(params[0]))
    finals = await collect(outputs, len(prompts))
    choices = []
    for i, out in enumerate(finals):
        for o in out.outputs:
            text, logprobs = o.text, None
            if req.logprobs is not None:
                logprobs = p.CompletionLogprobs()
                if req.echo:
                    fmt.extend_legacy(
                        logprobs,
                        out.prompt_token_ids,
                        fmt.prompt_logprobs(out),
                        req.logprobs,
                        serving.tokenizer,
                    )
                fmt.extend_legacy(logprobs, o.token_ids, o.logprobs, req.logprobs, serving.tokenizer)
            if req.echo:
                text = (prompts[i].text or "") + text
            choices.append(
                p.CompletionChoice(
                    index=i * req.n + o.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=o.finish_reason,
                    stop_reason=o.stop_reason,
                )
            )
    return p.CompletionResponse(
        id=rid, created=int(time.time()), model=serving.model_name, choices=choices, usage=usage_of(finals)
    )


async def _stream_completion(
    serving: OpenAIServing,
    rid: str,
    req: p.CompletionRequest,
    prompts: list[TokenizedPrompt],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    wait: bool,
) -> AsyncIterator[bytes]:
    """SSE chunks of every prompt's choices; choice `prompt_index * n + output index`. With `wait` (see
    `final_only`) each choice comes whole in one chunk when its prompt's request is done."""
    created = int(time.time())
    states: dict[tuple[int, int], ChoiceState] = {}
    finals: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(outputs):
        async for i, out in outputs:
            if wait and not out.finished:
                continue
            choices = []
            for o in out.outputs:
                st = states.setdefault((i, o.index), ChoiceState())
                if st.done:
                    continue
                text, logprobs = "", None
                if req.logprobs is not None:
                    logprobs = p.CompletionLogprobs()
                if not st.started and req.echo:
                    text = prompts[i].text or ""
                    if logprobs is not None:
                        st.text_offset = fmt.extend_legacy(
                            logprobs,
                            out.prompt_token_ids,
                            fmt.prompt_logprobs(out),
                            req.logprobs,
                            serving.tokenizer,
                            st.text_offset,
                        )
                st.started = True
                delta, new_ids, new_lps = advance(st, o)
                text += delta
                if logprobs is not None:
                    st.text_offset = fmt.extend_legacy(
                        logprobs, new_ids, new_lps, req.logprobs, serving.tokenizer, st.text_offset
                    )
                if text or new_ids or st.done:
                    choices.append(
                        p.CompletionChoice(
                            index=i * req.n + o.index,
                            text=text,
                            logprobs=logprobs,
                            finish_reason=o.finish_reason if st.done else None,
                            stop_reason=o.stop_reason if st.done else None,
                        )
                    )
            if out.finished:
                raise_if_failed(out)
                finals[i] = out
            if choices:
                yield sse(
                    p.CompletionResponse(id=rid, created=created, model=serving.model_name, choices=choices)
                )
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse(
            p.CompletionResponse(
                id=rid,
                created=created,
                model=serving.model_name,
                choices=[],
                usage=usage_of(list(finals.values())),
            )
        )
    yield SSE_DONE
