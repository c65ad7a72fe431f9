"""An FP8 KV cache (`kv_cache_dtype="fp8"`) end to end on the default model, on the CPU (the torch references: an
exact emulation): the same memory holds 4x an f32 cache's blocks, its logits stay close to f32's, greedy outputs
are unchanged when a tiny cache forces preemption by recompute and by swap (blocks move as bytes) and every block
comes back; values it does not run and GPUs without FP8 are refused before the cache is allocated."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tinypaged import LLM, SamplingParams
from tinypaged.config import EngineConfig
from tinypaged.engine.device.kv_scales import resolve_kv_cache_dtype
from tinypaged.errors import ConfigError

WORDS = "the a river mountain quickly blue seven engine paged memory block table copy write token".split()
_rng = random.Random(7)
PROMPTS = [" ".join(_rng.choice(WORDS) for _ in range(_rng.randint(3, 14))) for _ in range(6)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def fp8(model_dir: Path) -> LLM:
    return LLM(model=model_dir, kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def reference(fp8: LLM) -> list[list[int]]:
    """Greedy outputs with a roomy FP8 cache: nothing is preempted."""
    before = fp8.engine.scheduler.num_preemptions
    outs = [list(o.outputs[0].token_ids) for o in fp8.generate(PROMPTS, PARAMS)]
    assert fp8.engine.scheduler.num_preemptions == before
    return outs


def test_same_memory_holds_more_blocks(fp8: LLM, llm: LLM) -> None:
    """One byte a value: the CPU cache's budget (cpu_kv_cache_space) holds 4x the f32 cache's blocks."""
    ours, theirs = fp8.engine.runner, llm.engine.runner
    assert ours.kv_cache.dtype == ours.swap_cache.dtype == torch.float8_e4m3fn
    assert ours.stats.kv_cache_dtype == "float8_e4m3fn" and theirs.stats.kv_cache_dtype == "float32"
    assert ours.block_bytes * 4 == theirs.block_bytes
    assert abs(ours.num_gpu_blocks - 4 * theirs.num_gpu_blocks) < 4
    assert abs(ours.num_cpu_blocks - 4 * theirs.num_cpu_blocks) < 4  # each rounded down
    assert fp8.engine.stats().num_gpu_blocks == ours.num_gpu_blocks


def test_logits_close_to_f32(fp8: LLM, llm: LLM) -> None:
    """The prompt's next-token log-probabilities with FP8 keys and values, against the f32 cache's."""
    prompt = llm.engine.tokenizer.encode(" ".join(PROMPTS))
    ours = fp8.engine.runner.prompt_logits([prompt])[0].log_softmax(-1)
    theirs = llm.engine.runner.prompt_logits([prompt])[0].log_softmax(-1)
    chosen = theirs.argmax(-1, keepdim=True)
    err = (ours.gather(1, chosen) - theirs.gather(1, chosen)).abs()
    # E4M3 keeps 3 mantissa bits: on an English text the mean error is about 0.11 (docs/quantization.md).
    assert err.mean() < 0.25 and err.max() < 2.0, (err.mean(), err.max())
    assert not torch.equal(ours, theirs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_unchanged_under_preemption(
    model_dir: Path, reference: list[list[int]], mode: str, generate_with_stats
) -> None:
    # 4 blocks of 8 tokens hold 1-2 of the 6 sequences at their full length (up to ~30 tokens each).
    small = LLM(
        model=model_dir,
        kv_cache_dtype="fp8",
        block_size=8,
        num_gpu_blocks_override=4,
        preemption_mode=mode,
        swap_space=0.01,
    )
    outs, steps = generate_with_stats(small.engine, PROMPTS, [PARAMS] * len(PROMPTS))
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
    assert sum(s.num_preempted for s in steps) > 0
    if mode == "swap":
        assert any(s.num_blocks_swapped_in for s in steps)
    small.engine.check_integrity()
    stats = small.engine.stats()
    assert (
        stats.num_free_gpu_blocks == stats.num_gpu_blocks
        and stats.num_free_cpu_blocks == stats.num_cpu_blocks
    )


@pytest.mark.parametrize("value", ["fp8_e5m2", "float8", "int8", "bfloat16"])
def test_values_not_run_are_refused(model_dir: Path, value: str) -> None:
    with pytest.raises(
        ConfigError, match=f"^kv_cache_dtype must be one of auto, fp8, fp8_e4m3; got '{value}'$"
    ):
        EngineConfig(model=model_dir, kv_cache_dtype=value)


def test_alias_and_auto() -> None:
    cpu = torch.device("cpu")
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32, cpu) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16


def test_gpu_without_fp8_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An A100 (8.0) has no FP8 conversions: refused when the runner starts, before the model or the cache."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"kv_cache_dtype fp8 needs a GPU with FP8 .* is 8\.0"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda:0"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda:0")) == torch.float8_e4m3fn
