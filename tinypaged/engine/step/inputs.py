"""The one check of every request, whichever client sends it (the offline LLM, the CLI, the HTTP server):
sampling parameters against the engine's limits, the prompt tokenized and held to the vocabulary and the
context. A request that cannot run raises RequestError naming the parameter, before anything is queued."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tinypaged import limits
from tinypaged.config import EngineConfig
from tinypaged.engine.request import EngineRequest, Prompt
from tinypaged.engine.sampling.structured import GrammarCompiler, wait
from tinypaged.errors import RequestError
from tinypaged.sampling_params import SamplingParams
from tinypaged.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance import LLMatcher


def logprob_entries(params: SamplingParams, prompt_len: int, max_model_len: int) -> int:
    """Logprob entries a request can make the engine keep: sequences x output tokens x (1 + logprobs), plus
    prompt tokens x (1 + prompt_logprobs). What it holds grows with this, so this is what is bounded."""
    entries = 0
    if params.logprobs is not None:
        room = max(max_model_len - prompt_len, 0)
        tokens = min(params.max_tokens or room, room)
        entries += params.num_seqs * tokens * (params.logprobs + 1)
    if params.prompt_logprobs is not None:
        entries += prompt_len * (params.prompt_logprobs + 1)
    return entries


def check_logprob_entries(entries: int) -> None:
    """RequestError (naming `logprobs`) past limits.MAX_LOGPROB_ENTRIES, for one request or one HTTP request's
    prompts together."""
    if entries > limits.MAX_LOGPROB_ENTRIES:
        raise RequestError(
            f"this request could keep {entries} logprob entries (sequences x tokens x (1 + logprobs), plus "
            f"prompt tokens x (1 + prompt_logprobs)), more than the limit of {limits.MAX_LOGPROB_ENTRIES}: "
            "ask for fewer sequences, tokens or logprobs",
            "logprobs",
        )


class InputProcessor:
    """Turns (request id, prompt, params) into a checked EngineRequest."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, grammars: GrammarCompiler | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        tokenizer.max_token_chars  # noqa: B018 - computed now, not in the first request (0.1 s for 128k tokens)
        self.grammars = grammars
        self.vocab_size = config.model_config.vocab_size

    def process(self, request_id: str, prompt: Prompt, params: SamplingParams) -> EngineRequest:
        """The checked request; RequestError naming the parameter if it cannot run. A grammar (structured
        outputs) is handed to the compile pool, not waited for: the request carries the future (without a pool,
        none: the engine core's process compiles it)."""
        cfg, vocab = self.config, self.vocab_size
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        params.verify()
        if params.num_seqs > cfg.max_num_seqs:
            # One request's sequences are scheduled together (they share the prompt's blocks): all must fit.
            name = "best_of" if params.best_of is not None else "n"
            raise RequestError(
                f"{name} must be at most max_num_seqs ({cfg.max_num_seqs}), got {params.num_seqs}", name
            )
        if params.use_beam_search and cfg.speculative is not None:
            raise RequestError(
                "beam search cannot run on an engine with speculative decoding (speculative_config)",
                "use_beam_search",
            )
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise RequestError(f"stop token id {bad[0]} is out of range [0, {vocab})", "stop_token_ids")
        text, ids = self._tokenize(prompt)
        assert cfg.max_model_len is not None
        if len(ids) >= cfg.max_model_len:
            raise context_length_error(cfg.max_model_len, len(ids))
        check_logprob_entries(logprob_entries(params, len(ids), cfg.max_model_len))
        spec = params.structured_outputs
        grammar = self.grammars.start(spec) if spec is not None and self.grammars is not None else None
        return EngineRequest(request_id, text, ids, params, grammar)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """A prompt's text (if any) and its token ids, each id in the vocabulary."""
        if isinstance(prompt, str):
            assert self.config.max_model_len is not None
            if self.tokenizer.surely_longer_than(prompt, self.config.max_model_len):
                raise context_length_error(self.config.max_model_len)  # not worth tokenizing
            text, ids = prompt, self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), list | tuple):
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if text is not None and not isinstance(text, str):
                raise RequestError(f"a prompt's text is a string, got {type(text).__name__}", "prompt")
            vocab = self.vocab_size
            # The check in C (types, then bounds) first: a Python loop over every id was most of a W1 batch's
            # host time before its first step, while the device waits (BENCHMARKS.md, "W1 is device-bound end
            # to end"). The loop only names the culprit.
            if not ids or set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= vocab:
                bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
                if bad:
                    raise RequestError(f"prompt token id {bad[0]!r} is out of range [0, {vocab})", "prompt")
        else:
            got = f"a dict with keys {sorted(prompt)}" if isinstance(prompt, dict) else type(prompt).__name__
            raise RequestError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {got}", "prompt")
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        return text, ids


def wait_grammar(
    request: EngineRequest, timeout: float = limits.GRAMMAR_COMPILE_TIMEOUT_S
) -> LLMatcher | None:
    """The matcher of a checked request (None without structured outputs), waited for; RequestError naming the
    parameter if its grammar is invalid or does not compile in time."""
    spec = request.params.structured_outputs
    if request.grammar is None or spec is None:
        return None
    return wait(request.grammar, f"structured_outputs.{spec.kind}", timeout)


def context_length_error(max_model_len: int, num_tokens: int | None = None) -> RequestError:
    """The refusal of a prompt that leaves no room for output (of `num_tokens` tokens, or known to be too long
    from its size alone), in OpenAI's words."""
    has = f"has {num_tokens} tokens" if num_tokens is not None else "is far longer than that"
    return RequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt {has}, which "
        "leaves no room for output. Please reduce the length of the prompt.",
        "prompt",
        "context_length_exceeded",
    )
