"""The model's forward pass through the Triton kernels (interpreter) against the torch references, on a tiny random
Llama: a ragged prefill, then decode steps, with the staging's launch hints (so that decode steps take the decode
kernels' path, as the engine's do)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinypaged import ops
from tinypaged.config import ModelConfig
from tinypaged.model.llama import LlamaForCausalLM


def tiny_model(num_kv_heads: int, seed: int) -> LlamaForCausalLM:
    """Two layers of GQA (4 query heads) with random weights and norms, float32."""
    cfg = ModelConfig(
        path=Path("."),
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        vocab_size=97,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=None,
        eos_token_ids=(),
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg, max_positions=128)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.init_rope()
    return model.eval()


@pytest.mark.parametrize(("num_kv_heads", "block_size"), [(2, 8), (1, 16), (4, 4)])
def test_prefill_then_decode_equals_the_references(num_kv_heads: int, block_size: int, run_paged) -> None:
    model = tiny_model(num_kv_heads, seed=block_size)
    gen = torch.Generator().manual_seed(num_kv_heads)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 17, 1)]
    decodes = [torch.randint(0, 97, (3,), generator=gen).tolist() for _ in prompts]
    got = run_paged(model, prompts, block_size, decodes)
    with ops.torch_reference_ops():
        want = run_paged(model, prompts, block_size, decodes)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
