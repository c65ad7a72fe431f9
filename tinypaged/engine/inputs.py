"""The one check of every request, whichever client sends it (the offline LLM, the CLI, the HTTP server):
sampling parameters against the engine's limits, the prompt tokenized and held to the vocabulary and the
context. A request that cannot run raises RequestError naming the parameter, before anything is queued."""

from __future__ import annotations

from tinypaged.config import EngineConfig
from tinypaged.engine.request import EngineRequest, Prompt
from tinypaged.errors import RequestError
from tinypaged.sampling_params import SamplingParams
from tinypaged.tokenizer import Tokenizer


class InputProcessor:
    """Turns (request id, prompt, params) into a checked EngineRequest."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = config.model_config.vocab_size

    def process(self, request_id: str, prompt: Prompt, params: SamplingParams) -> EngineRequest:
        """The checked request; RequestError naming the parameter if it cannot run."""
        cfg, vocab = self.config, self.vocab_size
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        params.verify()
        if params.prompt_logprobs is not None and cfg.enable_prefix_caching:
            raise RequestError(
                "prompt_logprobs cannot be used with prefix caching (cached prompt tokens are not run)",
                "prompt_logprobs",
            )
        if params.num_seqs > cfg.max_num_seqs:
            # One request's sequences are scheduled together (they share the prompt's blocks): all must fit.
            name = "best_of" if params.best_of is not None else "n"
            raise RequestError(
                f"{name} must be at most max_num_seqs ({cfg.max_num_seqs}), got {params.num_seqs}", name
            )
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise RequestError(f"stop token id {bad[0]} is out of range [0, {vocab})", "stop_token_ids")
        text, ids = self._tokenize(prompt)
        assert cfg.max_model_len is not None
        if len(ids) >= cfg.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, your prompt "
                f"has {len(ids)} tokens, which leaves no room for output. Please reduce the length of the "
                "prompt.",
                "prompt",
                "context_length_exceeded",
            )
        return EngineRequest(request_id, text, ids, params)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """A prompt's text (if any) and its token ids, each id in the vocabulary."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), list | tuple):
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if text is not None and not isinstance(text, str):
                raise RequestError(f"a prompt's text is a string, got {type(text).__name__}", "prompt")
            vocab = self.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise RequestError(f"prompt token id {bad[0]!r} is out of range [0, {vocab})", "prompt")
        else:
            got = f"a dict with keys {sorted(prompt)}" if isinstance(prompt, dict) else type(prompt).__name__
            raise RequestError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {got}", "prompt")
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        return text, ids
