"""What the OpenAI endpoints share: the HTTP API's own checks, requests to SamplingParams, the engine's
streams (its refusals as 400s: errors.py), tokenize.

Nothing in the server's endpoint modules knows aiohttp: an endpoint returns a response Struct, or an async
iterator of SSE event bytes whose first item comes after the request's first step (so a request that fails
early still gets a proper status). completions.py and chat.py build on this module and responses.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from tinypaged.config import EngineConfig
from tinypaged.engine.frontend.client import EngineClient
from tinypaged.engine.step.inputs import check_logprob_entries, context_length_error, logprob_entries
from tinypaged.errors import EngineDeadError, EngineError, RequestError
from tinypaged.outputs import RequestOutput
from tinypaged.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tinypaged.server import protocol as p
from tinypaged.server.body import loads
from tinypaged.server.chat_template import template_message
from tinypaged.server.errors import APIError, engine_unavailable, internal_error, request_error
from tinypaged.server.messages import ChatMessage
from tinypaged.server.metrics import ServerMetrics

_LONG_TEXT = 8192  # tokenize texts longer than this (characters) in a thread, off the event loop


# The server's only reads of the model's part of EngineConfig (beside max_model_len): one line each to change
# if the config is reshaped again.
def model_path(config: EngineConfig) -> Path:
    """The served model's directory (`config.model` once built, which is typed to take a str or None too)."""
    return config.model_config.path


def vocab_size(config: EngineConfig) -> int:
    """The number of token ids the model knows."""
    return config.model_config.vocab_size


@dataclass
class TokenizedPrompt:
    """A prompt's text (None when given as token ids) and its token ids."""

    text: str | None
    ids: list[int]


def final_only(params: SamplingParams) -> bool:
    """Whether a stream sends each choice only once the request is done: with best_of > n or beam search,
    which sequences are returned (and in what order) is known only at the end."""
    return params.use_beam_search or params.num_seqs > params.n


class OpenAIServing:
    """The served model behind the endpoints: its engine, tokenizer, name, limits and metrics."""

    def __init__(
        self, engine: EngineClient, model_name: str, metrics: ServerMetrics, max_queue_len: int | None
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.tokenizer.max_token_chars  # noqa: B018 - computed now, not in the first request (0.1 s for 128k tokens)
        self.model_name = model_name
        self.metrics = metrics
        self.max_queue_len = max_queue_len
        max_model_len = engine.config.max_model_len
        assert max_model_len is not None  # a built config has it (the model's, when not given)
        self.max_model_len = max_model_len
        self.created = int(time.time())

    # ---- checks shared by the endpoints ---------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        """404 unless `name` is absent or the served model's name."""
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def check_queue(self, new_seqs: int, param: str) -> None:
        """`max_queue_len` counts the sequences waiting (prompts x best_of, or n): 503 with Retry-After when
        this request's `new_seqs` would pass it; 400 for a request larger than the whole queue."""
        limit = self.max_queue_len
        if limit is None:
            return
        if new_seqs > limit:
            raise APIError(
                400,
                f"This request would queue {new_seqs} sequences (prompts x best_of, or n), more than the "
                f"server's max_queue_len of {limit}.",
                param=param,
            )
        waiting = self.engine.stats().num_waiting_seqs
        if waiting + new_seqs > limit:
            raise APIError(
                503,
                f"The server is overloaded: {waiting} sequences are waiting and this request adds {new_seqs} "
                f"(max_queue_len {limit}); retry later.",
                type="server_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of a text. One that is surely longer than the context is refused by its size, untokenized;
        a long one is tokenized in a thread with the GIL released, so the event loop keeps serving."""
        if self.tokenizer.surely_longer_than(text, self.max_model_len):
            raise request_error(context_length_error(self.max_model_len), param)
        if len(text) > _LONG_TEXT:
            return await asyncio.to_thread(self.tokenizer.encode_unlocked, text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    def max_tokens(self, prompt_len: int, requested: int | None, default: int | None) -> int | None:
        """The completion budget: the request's, else `default`, else all the room the prompt leaves.

        OpenAI's rule (not the engine's, which stops at max_model_len): an explicit max_tokens must fit beside
        the prompt, else 400. A prompt that leaves no room at all is the engine's to refuse (None here).
        """
        room = self.max_model_len - prompt_len
        if room <= 0:
            return None
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                f"{requested} for the completion). Please reduce the length of the prompt or "
                f"completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def structured_outputs(
        self, req: p.CompletionRequest | p.ChatCompletionRequest
    ) -> tuple[StructuredOutputsParams, str] | None:
        """The constraint of `response_format` or vLLM's `structured_outputs` (at most one of them), with the
        parameter a bad one is named by in the 400."""
        fmt, so = req.response_format, req.structured_outputs
        if fmt is not None and not isinstance(fmt, p.TextFormat) and so is not None:
            raise APIError(
                400, "give at most one of response_format and structured_outputs", param="response_format"
            )
        try:
            if isinstance(fmt, p.JsonObjectFormat):
                return StructuredOutputsParams(json_object=True), "response_format"
            if isinstance(fmt, p.JsonSchemaFormat):
                schema = fmt.json_schema.schema
                spec = StructuredOutputsParams(json=schema if schema is not None else {"type": "object"})
                return spec, "response_format.json_schema.schema"
            if so is not None:
                fields = msgspec.structs.asdict(so)
                if isinstance(so.json, str):  # a schema as text: parsed here, its nesting bounded first
                    try:
                        fields["json"] = loads(so.json, "structured_outputs.json")
                    except ValueError as e:
                        raise RequestError(
                            f"a JSON schema must be valid JSON: {e}", "structured_outputs.json"
                        ) from e
                return StructuredOutputsParams(**fields), "structured_outputs"
        except RequestError as e:
            param = e.param if so is not None else "response_format.json_schema.schema"
            raise APIError(400, str(e), param=param) from e
        return None

    async def compile_grammar(self, params: SamplingParams, param: str) -> None:
        """Compile the request's grammar before it is queued (off the event loop, cached by the engine): an
        invalid, unsupported or too slow one is a 400 naming `param` (what the request called it; the engine's
        own name under `structured_outputs`)."""
        try:
            await self.engine.compile_grammar(params)
        except RequestError as e:
            keep = param == "structured_outputs" and e.param is not None
            raise APIError(400, str(e), param=e.param if keep else param) from e
        except EngineDeadError as e:  # dead or stalled: the same 503 as any other request gets
            raise engine_unavailable(e) from e

    def sampling_params(
        self,
        req: p.CompletionRequest | p.ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams; SamplingParams' own checks come back as 400s naming the field."""
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        try:
            params = SamplingParams(
                n=req.n,
                best_of=req.best_of,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=stop,
                stop_token_ids=list(req.stop_token_ids or []),
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                use_beam_search=req.use_beam_search,
                length_penalty=req.length_penalty,
                early_stopping=req.early_stopping,
                structured_outputs=structured,
            )
        except RequestError as e:
            raise request_error(e) from e
        # A request read only at its end asks the engine for its final output alone: no RequestOutput, and no
        # detokenization without stop strings, each step (its TTFT and TPOT come from the output's metrics).
        if not req.stream or final_only(params):
            params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        return params

    # ---- generation -----------------------------------------------------------------------------------

    async def _track(
        self, gen: AsyncGenerator[RequestOutput, None], request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """Pass a request's outputs through, observing TTFT, time per output token and E2E latency; a failure
        inside the engine as a 500 naming the request (the details are in the server's log).

        The token times are the engine's (`RequestOutput.metrics`: the steps that gave the request its first
        and its latest tokens), so a request asking for its final output alone is timed as a streamed one is:
        TTFT from its arrival here to its first token, then the time per token of each stretch of tokens
        between the outputs seen (the whole rest of the request, for a final-only one)."""
        start = time.monotonic()
        last, seen = 0.0, 0
        outcome: str | None = "abort"  # what to count if the request ends early: a client gone, a shutdown
        try:
            async for out in gen:
                now = time.monotonic()
                # The request's steps so far: its longest output (with n > 1, output 0 may stop first).
                n = max((len(o.token_ids) for o in out.outputs), default=0)
                m = out.metrics
                if n > seen and m is not None and m.first_token_time is not None:
                    assert m.last_token_time is not None
                    if seen == 0:
                        self.metrics.ttft.observe(max(0.0, m.first_token_time - start))
                        last, seen = m.first_token_time, 1
                    if n > seen:
                        self.metrics.tpot.observe((m.last_token_time - last) / (n - seen))
                    last, seen = m.last_token_time, n
                if out.finished:
                    outcome = None
                    self.metrics.e2e.observe(now - start)
                    self.metrics.request_finished(
                        "error" if out.error or not out.outputs else out.outputs[0].finish_reason
                    )
                yield out
        except EngineDeadError as e:
            outcome = "error"
            raise engine_unavailable(e) from e
        except EngineError as e:
            outcome = "error"
            raise internal_error(request_id, str(e)) from e
        except RequestError as e:  # refused where it was queued (the engine core's own checks)
            outcome = "error"
            raise request_error(e) from e
        except Exception:
            outcome = "error"
            raise
        finally:
            if outcome is not None:
                self.metrics.request_finished(outcome)
            await gen.aclose()  # aborts the request in the engine if it is still running

    def generate(
        self,
        request_id: str,
        prompts: list[TokenizedPrompt],
        params: list[SamplingParams],
        prompt_param: str = "prompt",
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Start one engine request per prompt; their outputs merged, tagged with the prompt's index.

        A prompt's `n` (or `best_of`) sequences are one request: the engine forks them after the prompt, so
        they share its KV blocks; each output's `index` tells them apart. The queue check and the queueing run
        with no await between them, so concurrent requests cannot all pass a nearly full queue. A prompt the
        engine refuses is a 400 (`prompt_param`: what the request calls its prompt) and none of them runs.
        """
        self.check_queue(sum(sp.num_seqs for sp in params), prompt_param)
        # The engine bounds each prompt's logprobs; one HTTP request's prompts are bounded together too.
        if len(prompts) > 1:
            try:
                pairs = zip(prompts, params, strict=True)
                check_logprob_entries(
                    sum(logprob_entries(sp, len(pr.ids), self.max_model_len) for pr, sp in pairs)
                )
            except RequestError as e:
                raise request_error(e) from e
        gens: list[AsyncGenerator[RequestOutput, None]] = []
        try:
            for i, (pr, sp) in enumerate(zip(prompts, params, strict=True)):
                prompt = {"prompt": pr.text, "prompt_token_ids": pr.ids}
                # One HTTP request's prompts take one turn together (Scheduler: fairness).
                key = request_id if len(prompts) > 1 else None
                gens.append(self.engine.generate(prompt, sp, f"{request_id}-{i}", key))
        except (RequestError, EngineError) as e:
            for i in range(len(gens)):
                asyncio.ensure_future(self.engine.abort(f"{request_id}-{i}"))
            if isinstance(e, RequestError):
                raise request_error(e, prompt_param) from e
            if isinstance(e, EngineDeadError):
                raise engine_unavailable(e) from e
            raise internal_error(request_id, str(e)) from e
        return merge([self._track(g, f"{request_id}-{i}") for i, g in enumerate(gens)])

    async def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat template applied to the messages, and to the tools as HF passes them (400 if the template
        rejects them)."""
        dicts = [template_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
        # Rendering holds the GIL: a chat surely past the context (each message is at least a token, and no
        # token is longer than max_token_chars) is refused by its size, unrendered.
        chars = sum(len(d["content"]) for d in dicts)
        if len(dicts) > self.max_model_len or chars > self.max_model_len * self.tokenizer.max_token_chars:
            raise request_error(context_length_error(self.max_model_len), "messages")
        try:
            return self.tokenizer.apply_chat_template(
                dicts, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        except RecursionError as e:  # a template's own recursion (a macro per nesting level) on deep values
            raise APIError(
                400,
                "The chat template could not render the messages and tools: they nest too deeply for it.",
                param="tools" if tools else "messages",
            ) from e

    # ---- /tokenize, /detokenize, /v1/models -----------------------------------------------------------

    async def tokenize(self, req: p.TokenizeRequest) -> p.TokenizeResponse:
        """Token ids of a prompt or of chat messages."""
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            text = await self.render_chat(req.messages, req.add_generation_prompt)
            ids = await self.encode(text, False, "messages")
        else:
            ids = await self.encode(req.prompt or "", req.add_special_tokens, "prompt")
        return p.TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)

    async def detokenize(self, req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        """The text of token ids (many of them decoded in a thread, the GIL released)."""
        self.check_model(req.model)
        vocab = vocab_size(self.engine.config)
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:  # not a generation request: the engine never sees these ids
            raise APIError(400, f"token id {bad} is out of range [0, {vocab})", param="tokens")
        if len(req.tokens) > _LONG_TEXT // 4:
            return p.DetokenizeResponse(
                prompt=await asyncio.to_thread(self.tokenizer.decode_unlocked, req.tokens, False)
            )
        return p.DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens, False))

    def models(self) -> p.ModelList:
        """The one served model."""
        return p.ModelList(
            data=[
                p.ModelCard(
                    id=self.model_name,
                    created=self.created,
                    root=str(model_path(self.engine.config)),
                    max_model_len=self.max_model_len,
                )
            ]
        )


async def merge(
    gens: list[AsyncGenerator[RequestOutput, None]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave the outputs of several requests as they come, tagged with the request's index.

    Closing the merged iterator (or an error from one request) cancels and closes every request.
    """
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as gen:
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async with contextlib.aclosing(gen):
                async for out in gen:
                    queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
