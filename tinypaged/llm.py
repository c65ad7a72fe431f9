"""The offline entry point, vLLM-compatible: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tinypaged.config import EngineConfig
from tinypaged.engine.inputs import wait_grammar
from tinypaged.engine.llm_engine import LLMEngine
from tinypaged.engine.request import Prompt
from tinypaged.outputs import RequestOutput
from tinypaged.sampling_params import RequestOutputKind, SamplingParams
from tinypaged.tokenizer import Tokenizer


class LLM:
    """A model with its engine, for batched offline generation.

    `LLM(model=None, **engine_args)`: the model directory (None: the default model, fetched if missing) and any
    field of EngineConfig (`block_size=`, `max_num_seqs=`, `tensor_parallel_size=`, ...: vLLM's names).
    `shutdown()` (or leaving a `with LLM(...) as llm:` block) stops the tensor-parallel workers at once; they
    also stop when the LLM is garbage collected or the process exits.
    """

    def __init__(self, model: str | Path | None = None, **engine_args: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, **engine_args)
        self.engine = LLMEngine(self.config)
        self._next_id = 0

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the engine and every tensor-parallel rank, freeing their devices; the LLM cannot generate
        afterwards."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, e.g. between benchmark runs of the same prompts (vLLM's name); False while
        requests are running."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (vLLM's name)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched; outputs come back in the prompts' order.

        All requests are checked (their grammars compiled) before any runs, so a bad one raises RequestError
        (a ValueError naming the parameter) and nothing is left queued.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        params = final_only(params)
        first = self._next_id
        requests = [
            self.engine.process_inputs(str(first + i), prompt, sp)
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        self._next_id += len(requests)
        for request in requests:  # their grammars compile in parallel; a bad one is refused before any runs
            wait_grammar(request)
        for request in requests:
            self.engine.add(request)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step().outputs:
                if out.finished:
                    done[out.request_id] = out
        return [done[r.request_id] for r in requests]


def final_only(params: Sequence[SamplingParams]) -> list[SamplingParams]:
    """The same parameters asking the engine for finished outputs only (what a batch waits for); the caller's
    objects stay as they were, and each distinct one is copied once."""
    copies: dict[int, SamplingParams] = {}
    for p in params:
        if isinstance(p, SamplingParams) and id(p) not in copies:  # anything else the engine refuses
            # A shallow copy rather than dataclasses.replace, whose check the engine repeats as it takes each
            # request (256 copies: 10 -> 3 ms on a 2-core machine, before the batch's first step).
            copies[id(p)] = copy.copy(p)
            copies[id(p)].output_kind = RequestOutputKind.FINAL_ONLY
    return [copies.get(id(p), p) for p in params]
