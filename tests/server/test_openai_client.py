"""The official `openai` client against the real server: completions and chat, plain and streamed, n > 1,
logprobs, echo, stop strings, seeds and usage."""

from __future__ import annotations

import math

import openai
import pytest

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _stream_text(stream, n: int = 1) -> tuple[list[str], list[str | None], object]:
    """Concatenated text and finish reason per choice index, and the usage of the last chunk."""
    texts, reasons, usage = [""] * n, [None] * n, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] += piece
            if c.finish_reason is not None:
                assert reasons[c.index] is None, "a choice finished twice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_completion_greedy_plain_and_streamed_agree(client: openai.OpenAI, server) -> None:
    plain = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert plain.object == "text_completion" and plain.model == server.model
    (choice,) = plain.choices
    assert choice.text.strip() and choice.finish_reason in ("length", "stop")
    assert plain.usage.prompt_tokens == len(server.engine.tokenizer.encode(PROMPT))
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    stream = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, reasons, usage = _stream_text(stream)
    assert texts == [choice.text] and reasons == [choice.finish_reason]
    assert usage.completion_tokens == plain.usage.completion_tokens


def test_completion_prompt_forms(client: openai.OpenAI, server) -> None:
    ids = server.engine.tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0)
    out = client.completions.create(
        model=server.model, prompt=[PROMPT, "1, 2, 3,"], max_tokens=4, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == by_text.choices[0].text
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model=server.model, prompt=[ids, ids[:2]], max_tokens=4, temperature=0)
    assert many.choices[0].text == by_text.choices[0].text and len(many.choices) == 2
    assert many.usage.prompt_tokens == len(ids) + 2


def test_completion_echo_and_logprobs(client: openai.OpenAI, server) -> None:
    out = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    (c,) = out.choices
    lp = c.logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 4
        # greedy: the chosen token is the most likely one
        assert math.isclose(top[tok], max(top.values()), abs_tol=1e-5) and math.isclose(top[tok], logprob)
    echo = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=5, temperature=0, echo=True
    )
    assert echo.choices[0].text == PROMPT + c.text
    both = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=1
    )
    lp, n_prompt = both.choices[0].logprobs, both.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + n and "".join(lp.tokens) == PROMPT + c.text
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])  # prompt_logprobs
    assert lp.token_logprobs[n_prompt:] == pytest.approx(c.logprobs.token_logprobs)


def _stop_across_tokens(tokens: list[str]) -> tuple[str, int]:
    """A two-character stop string made of one token's last character and the next one's first, found first
    at that boundary (past the middle of the text), and where it starts."""
    text = "".join(tokens)
    for j in range(len(tokens) // 2, len(tokens)):
        if tokens[j - 1] and tokens[j]:
            stop, at = tokens[j - 1][-1] + tokens[j][0], len("".join(tokens[:j])) - 1
            if text.find(stop) == at:
                return stop, at
    raise AssertionError(f"no token boundary to stop at in {tokens}")


def test_stop_string_never_streamed_then_cut(client: openai.OpenAI, server) -> None:
    # The stop string begins in one token and ends in the next: a stream that sent the first token's text
    # whole would send a character that the finished text then cuts. The engine holds such a tail back (the
    # server holds back nothing itself), so the streamed text is exactly the plain one.
    greedy = {"model": server.model, "max_tokens": 12, "temperature": 0}
    full = client.completions.create(prompt=PROMPT, logprobs=0, extra_body={"ignore_eos": True}, **greedy)
    tokens = full.choices[0].logprobs.tokens
    assert "".join(tokens) == full.choices[0].text
    stop, at = _stop_across_tokens(tokens)
    plain = client.completions.create(prompt=PROMPT, stop=[stop], **greedy).choices[0]
    assert (plain.text, plain.finish_reason, plain.stop_reason) == (full.choices[0].text[:at], "stop", stop)
    stream = client.completions.create(prompt=PROMPT, stop=[stop], stream=True, **greedy)
    assert _stream_text(stream) == ([plain.text], ["stop"], None)

    chat_full = client.chat.completions.create(messages=MESSAGES, logprobs=True, **greedy)
    (choice,) = chat_full.choices
    tokens = [t.token for t in choice.logprobs.content]
    if choice.finish_reason == "stop":
        tokens.pop()  # the end-of-turn token, not in the text
    assert "".join(tokens) == choice.message.content
    stop, at = _stop_across_tokens(tokens)
    stream = client.chat.completions.create(messages=MESSAGES, stop=[stop], stream=True, **greedy)
    assert _stream_text(stream) == ([choice.message.content[:at]], ["stop"], None)


def test_sampling_seed_repeats(client: openai.OpenAI, server) -> None:
    def run(seed: int) -> str:
        return (
            client.completions.create(
                model=server.model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    assert run(7) == run(7)


def test_chat_plain_and_streamed_agree(client: openai.OpenAI, server) -> None:
    plain = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_completion_tokens=8, temperature=0
    )
    assert plain.object == "chat.completion"
    (choice,) = plain.choices
    assert choice.message.role == "assistant" and choice.message.content
    rendered = server.engine.tokenizer.apply_chat_template(MESSAGES)
    assert plain.usage.prompt_tokens == len(server.engine.tokenizer.encode(rendered, False))
    stream = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, reasons, usage = _stream_text(stream)
    assert texts == [choice.message.content] and reasons == [choice.finish_reason]
    assert usage.total_tokens == plain.usage.total_tokens


def test_chat_logprobs(client: openai.OpenAI, server) -> None:
    out = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert math.isclose(t.logprob, t.top_logprobs[0].logprob, abs_tol=1e-5)
        assert bytes(t.bytes).decode() == t.token
    streamed = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    tokens = [t.token for chunk in streamed for c in chunk.choices if c.logprobs for t in c.logprobs.content]
    assert tokens == [t.token for t in content]


def _choices(client: openai.OpenAI, server, stream: bool, count: int, chat: bool = False, **kw) -> tuple:
    """(texts, finish reasons) by choice index of a completion or chat request, plain or streamed."""
    create = client.chat.completions.create if chat else client.completions.create
    kw.update(messages=MESSAGES) if chat else kw.setdefault("prompt", PROMPT)
    out = create(model=server.model, stream=stream, **kw)
    if stream:
        texts, reasons, _ = _stream_text(out, count)
        return texts, reasons
    assert sorted(c.index for c in out.choices) == list(range(count))
    by_index = sorted(out.choices, key=lambda c: c.index)
    texts = [c.message.content if chat else c.text for c in by_index]
    return texts, [c.finish_reason for c in by_index]


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_sampling_n(client: openai.OpenAI, server, stream: bool) -> None:
    # n sequences of one prompt are one engine request: the same seed gives the same samples either way.
    kw = {"max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 3}
    texts, reasons = _choices(client, server, stream, 3, **kw)
    assert all(reasons) and len(set(texts)) > 1, texts
    assert _choices(client, server, not stream, 3, **kw) == (texts, reasons)
    chat_texts, chat_reasons = _choices(client, server, stream, 2, chat=True, max_tokens=4, n=2, seed=1)
    assert all(chat_reasons) and len(chat_texts) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_sampling_n_over_prompts(client: openai.OpenAI, server, stream: bool) -> None:
    # Choice index = prompt index * n + output index, as OpenAI and vLLM number them.
    prompts = [PROMPT, "1, 2, 3,"]
    texts, reasons = _choices(
        client, server, stream, 4, prompt=prompts, max_tokens=5, temperature=1.0, seed=5, n=2
    )
    assert all(reasons)
    for i, prompt in enumerate(prompts):
        alone = _choices(client, server, False, 2, prompt=prompt, max_tokens=5, temperature=1.0, seed=5, n=2)
        assert alone == (texts[2 * i : 2 * i + 2], reasons[2 * i : 2 * i + 2])


@pytest.mark.parametrize("stream", [False, True])
def test_best_of(client: openai.OpenAI, server, stream: bool) -> None:
    kw = {"max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 2, "extra_body": {"best_of": 4}}
    texts, reasons = _choices(client, server, stream, 2, **kw)
    assert all(reasons) and _choices(client, server, not stream, 2, **kw) == (texts, reasons)
    out = client.completions.create(model=server.model, prompt=PROMPT, logprobs=0, **kw)
    cum = [sum(c.logprobs.token_logprobs) for c in sorted(out.choices, key=lambda c: c.index)]
    assert cum == sorted(cum, reverse=True)  # the n most likely of the best_of samples, best first


@pytest.mark.parametrize("stream", [False, True])
def test_beam_search(client: openai.OpenAI, server, stream: bool) -> None:
    beams = {"use_beam_search": True, "best_of": 4, "length_penalty": 0.5, "early_stopping": "never"}
    kw = {"prompt": "Water boils at a temperature of", "max_tokens": 10, "temperature": 0, "n": 3}
    out = client.completions.create(model=server.model, logprobs=0, extra_body=beams, **kw)
    choices = sorted(out.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2]
    scores = [sum(c.logprobs.token_logprobs) / len(c.logprobs.tokens) ** 0.5 for c in choices]
    assert scores == sorted(scores, reverse=True), scores  # ranked by HF's length-penalised score
    texts, reasons = _choices(client, server, stream, 3, extra_body=beams, **kw)
    assert texts == [c.text for c in choices] and reasons == [c.finish_reason for c in choices]
    chat = _choices(client, server, stream, 2, chat=True, max_tokens=6, temperature=0, n=2, extra_body=beams)
    assert all(chat[1]) and len(set(chat[0])) == 2


def test_models(client: openai.OpenAI, server) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
