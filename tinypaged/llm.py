"""The offline entry point, vLLM-compatible: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tinypaged.config import EngineConfig
from tinypaged.engine.request import EngineRequest, Prompt
from tinypaged.engine.step.inputs import wait_grammar
from tinypaged.engine.step.llm_engine import LLMEngine
from tinypaged.engine.step.stats import StepResult
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

        A bad request raises RequestError (a ValueError naming the parameter) and leaves nothing queued: the
        requests queued before it are aborted, their blocks freed; so is the rest of the batch when a step fails
        (StepError).
        """
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        for result in self.batch_steps(prompts, sampling_params, ids):
            done.update((out.request_id, out) for out in result.outputs if out.finished)
        return [done[rid] for rid in ids]

    def batch_steps(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        request_ids: list[str],
    ) -> Iterator[StepResult]:
        """`generate`'s engine steps, each StepResult as it comes (finished outputs only); `request_ids` gets the
        batch's ids in the prompts' order as they are queued.

        The requests that can fill the first step are checked and queued first and that step is launched;
        under async scheduling the rest are checked while the device runs it. A step takes waiting requests
        first come, first served up to its budget, so the steps are those of the batch queued whole (unless
        prefix-cache hits leave the first step room for more prompts, which then start a step later).
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
        self._next_id += len(prompts)
        pending = iter(enumerate(zip(prompts, params, strict=True)))
        try:
            arrival = (
                time.monotonic()
            )  # the whole batch's: the scheduler sees one arrival, as if queued whole
            self._queue(request_ids, self._first_step(pending, first), arrival)
            if len(request_ids) < len(prompts):
                yield self.engine.step()
                rest = [self.engine.process_inputs(str(first + i), p, sp) for i, (p, sp) in pending]
                self._queue(request_ids, rest, arrival)
            while self.engine.has_unfinished_requests():
                yield self.engine.step()
        except BaseException:  # a bad request, a failed step, or the caller leaving: none of the batch stays
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise

    def _first_step(
        self, pending: Iterator[tuple[int, tuple[Prompt, SamplingParams]]], first: int
    ) -> list[EngineRequest]:
        """Check requests from `pending` until they hold more prompt tokens or sequences than one step takes (or
        none are left): enough that the first step schedules what it would with the whole batch waiting."""
        cfg = self.config
        checked: list[EngineRequest] = []
        tokens = seqs = 0
        for i, (prompt, sp) in pending:
            checked.append(self.engine.process_inputs(str(first + i), prompt, sp))
            tokens += len(checked[-1].prompt_token_ids)
            seqs += sp.num_seqs
            if tokens > cfg.max_num_batched_tokens or seqs > cfg.max_num_seqs:
                break
        return checked

    def _queue(self, request_ids: list[str], checked: list[EngineRequest], arrival: float) -> None:
        """Queue checked requests once each grammar has compiled (they compile in parallel; a bad one is refused
        before any of `checked` is queued)."""
        for request in checked:
            wait_grammar(request)
        for request in checked:
            self.engine.add(replace(request, arrival_time=arrival))
            request_ids.append(request.request_id)


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
