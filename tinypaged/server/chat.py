"""`POST /v1/chat/completions`: messages through the chat template, chat logprobs, SSE streaming."""

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


async def create_chat_completion(
    serving: OpenAIServing, req: p.ChatCompletionRequest
) -> p.ChatCompletionResponse | AsyncIterator[bytes]:
    """`/v1/chat/completions`: the whole response, or its SSE events when `stream`."""
    serving.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    text = await serving.render_chat(req.messages, req.add_generation_prompt)
    prompt = TokenizedPrompt(text, await serving.encode(text, False))
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = serving.sampling_params(req, serving.max_tokens(len(prompt.ids), requested, None), top)
    serving.check_queue()
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    outputs = serving.generate(rid, [prompt], [params], prompt_param="messages")
    if req.stream:
        return _stream_chat(serving, rid, req, outputs, final_only(params))
    (out,) = await collect(outputs, 1)
    choices = [
        p.ChatChoice(
            index=o.index,
            message=p.ChatResponseMessage(content=o.text),
            logprobs=fmt.chat_logprobs(o.token_ids, o.logprobs, top, serving.tokenizer)
            if top is not None
            else None,
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
        )
        for o in out.outputs
    ]
    return p.ChatCompletionResponse(
        id=rid, created=int(time.time()), model=serving.model_name, choices=choices, usage=usage_of([out])
    )


async def _stream_chat(
    serving: OpenAIServing,
    rid: str,
    req: p.ChatCompletionRequest,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    wait: bool,
) -> AsyncIterator[bytes]:
    """SSE chunks: each choice's role first, then its content deltas by output index, then its finish
    reason. With `wait` (see `final_only`) the choices come whole when the request is done."""
    created = int(time.time())
    top = (req.top_logprobs or 0) if req.logprobs else None
    states: dict[int, ChoiceState] = {}
    final: list[RequestOutput] = []

    def chunk(choices: list[p.ChatChunkChoice], usage: p.UsageInfo | None = None) -> bytes:
        return sse(
            p.ChatCompletionChunk(
                id=rid, created=created, model=serving.model_name, choices=choices, usage=usage
            )
        )

    async with contextlib.aclosing(outputs):
        async for _, out in outputs:
            if wait and not out.finished:
                continue
            new = [o.index for o in out.outputs if o.index not in states]
            if new:  # OpenAI's first chunk of each choice carries only the role
                yield chunk(
                    [
                        p.ChatChunkChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))
                        for i in new
                    ]
                )
            choices = []
            for o in out.outputs:
                st = states.setdefault(o.index, ChoiceState())
                if st.done:
                    continue
                delta, new_ids, new_lps = advance(st, o)
                if delta or new_ids or st.done:
                    lps = (
                        fmt.chat_logprobs(new_ids, new_lps, top, serving.tokenizer)
                        if top is not None
                        else None
                    )
                    choices.append(
                        p.ChatChunkChoice(
                            index=o.index,
                            delta=p.DeltaMessage(content=delta),
                            logprobs=lps,
                            finish_reason=o.finish_reason if st.done else None,
                            stop_reason=o.stop_reason if st.done else None,
                        )
                    )
            if out.finished:
                raise_if_failed(out)
                final.append(out)
            if choices:
                yield chunk(choices)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], usage_of(final))
    yield SSE_DONE
