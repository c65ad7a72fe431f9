"""A model whose every layer is windowed (Mistral v0.1's shape, tiny) through the whole engine: HF's greedy tokens,
with the blocks that the window has passed given back between steps and chunks (measured from the block manager),
under prefix caching and swap preemption too."""

import math
from pathlib import Path

import pytest
import torch

from tinypaged import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

WINDOW, BLOCK, CHUNK = 8, 4, 8


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, tiny_hf_model) -> Path:
    """A tiny random Mistral with a window of 8 and the default model's tokenizer (vocab sized to match)."""
    out = tmp_path_factory.mktemp("mistral")
    return tiny_hf_model(out, "Mistral", head_dim=16, max_position_embeddings=128, sliding_window=WINDOW)


def test_window_releases_blocks_and_keeps_hf_tokens(windowed: Path, generate_with_stats) -> None:
    hf = transformers.MistralForCausalLM.from_pretrained(windowed, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (30, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with torch.no_grad():
        want = [
            hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    llm = LLM(
        model=windowed,
        block_size=BLOCK,
        max_num_batched_tokens=CHUNK,
        num_gpu_blocks_override=64,
        enable_prefix_caching=False,
    )
    assert llm.engine.kv.sliding_window == WINDOW
    outs, steps = generate_with_stats(llm.engine, [{"prompt_token_ids": p} for p in prompts], [params] * 2)
    assert [o.outputs[0].token_ids for o in outs] == want
    # Between steps: at most ceil(window / block) + 1 blocks a sequence (two sequences here).
    assert max(64 - s.num_free_blocks for s in steps) <= 2 * (math.ceil(WINDOW / BLOCK) + 1)
    assert llm.engine.stats().num_free_gpu_blocks == 64


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_window_under_prefix_caching_and_preemption(windowed: Path, mode: str, generate_with_stats) -> None:
    """Prompts sharing a prefix longer than the window on a cache too small for all of them: the same tokens as
    one sequence at a time on a roomy cache, with preemptions."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 49152, (20,), generator=g).tolist()
    prompts = [{"prompt_token_ids": shared + [i, i + 1]} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    roomy = LLM(model=windowed, block_size=BLOCK, num_gpu_blocks_override=64, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    small = LLM(
        model=windowed,
        block_size=BLOCK,
        num_gpu_blocks_override=12,
        preemption_mode=mode,
        swap_space=0.01,
        max_num_batched_tokens=CHUNK,
    )
    outs, steps = generate_with_stats(small.engine, prompts, [params] * 6)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(s.num_preempted for s in steps) > 0
    small.engine.check_integrity()
