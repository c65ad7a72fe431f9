"""The default model served from its GGUF as shipped (Q4_1 kept quantized, on the CPU's reference path) against
its f32 conversion: the same weights (test_gguf_quant.py shows them equal bit for bit), so greedy tokens agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from tinypaged import LLM, SamplingParams
from tinypaged.weights import fetch

PROMPTS = ["Write a haiku about the ocean.", "The three primary colors are", "def quicksort(arr):\n"]


def test_default_gguf_served_quantized_agrees_with_f32(
    gguf_path: Path, llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINYPAGED_HOME", str(tmp_path))
    model_dir = fetch.resolve_model(gguf_path)  # what LLM(model="x.gguf") loads, converted once
    assert fetch.resolve_model(gguf_path) == model_dir and fetch.is_complete(model_dir)
    quantized = LLM(model=gguf_path, seed=0)
    kinds = quantized.config.model_config.quantization_config["layers"]
    assert quantized.config.model == model_dir and set(kinds.values()) == {"Q4_1"} and len(kinds) == 30 * 7
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ours = [list(o.outputs[0].token_ids) for o in quantized.generate(PROMPTS, greedy)]
    want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)]
    same = sum(a == b for a, b in zip(ours, want, strict=True))
    print(f"greedy agreement with the f32 conversion: {same} of {len(PROMPTS)} prompts over 24 tokens")
    assert same >= 2
