"""The offline entry point, vLLM-compatible: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from tinypaged.config import EngineConfig
from tinypaged.engine.llm_engine import LLMEngine
from tinypaged.engine.request import Prompt
from tinypaged.outputs import RequestOutput
from tinypaged.sampling_params import SamplingParams
from tinypaged.weights.fetch import resolve_model


class LLM:
    """A model with its engine, for batched offline generation."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        swap_space: float = 4.0,
        enable_prefix_caching: bool = False,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        preemption_mode: Literal["recompute", "swap"] | None = None,
        enforce_eager: bool = False,
        async_scheduling: bool | None = None,
    ) -> None:
        self.config = EngineConfig.from_engine_args(
            resolve_model(model),
            dtype=dtype,
            device=device,
            seed=seed,
            block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization,
            num_gpu_blocks_override=num_gpu_blocks_override,
            swap_space=swap_space,
            enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            preemption_mode=preemption_mode,
            enforce_eager=enforce_eager,
            async_scheduling=async_scheduling,
        )
        self.engine = LLMEngine(self.config)
        self._next_id = 0

    def get_tokenizer(self):  # noqa: ANN201 (vLLM's name)
        """The model's tokenizer."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched; outputs come back in the prompts' order.

        All requests are checked before any runs, so a bad one raises RequestError (a ValueError naming the
        parameter) and nothing is left queued.
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
        first = self._next_id
        requests = [
            self.engine.process_inputs(str(first + i), prompt, sp)
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        self._next_id += len(requests)
        for request in requests:
            self.engine.add(request)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step().outputs:
                if out.finished:
                    done[out.request_id] = out
        return [done[r.request_id] for r in requests]
