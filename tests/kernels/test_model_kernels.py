"""The model's forward pass through the Triton kernels (interpreter) against the torch references, on a tiny random
Llama: a ragged prefill, then decode steps, with the staging's launch hints (so that decode steps take the decode
kernels' path, as the engine's do); dense, and with FP8 weights (the activations quantized by the kernels that
produce them)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from tinypaged import kernels, ops
from tinypaged.config import ModelConfig
from tinypaged.model.llama import LlamaForCausalLM
from tinypaged.model.quant import Linear, fp8
from tinypaged.quantization import Fp8Scheme, Quantization, linear_layers


def tiny_model(num_kv_heads: int, seed: int, quant: Quantization | None = None) -> LlamaForCausalLM:
    """Two layers of GQA (4 query heads) with random weights and norms, float32 (FP8 linear layers as `quant`
    says: E4M3 weights with per-row scales, quantized from random ones)."""
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
    model = LlamaForCausalLM(cfg, max_positions=128, quant=quant)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for layer in model.modules():
            if isinstance(layer, Linear) and layer.weight.dtype == fp8.FP8_DTYPE:
                q, scale = fp8.quantize_per_channel(torch.randn(layer.weight.shape, generator=gen) * 0.3)
                layer.weight.copy_(q)
                layer.weight_scale.copy_(scale)
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


def test_fp8_model_fuses_the_quantization_and_equals_the_references(
    run_paged, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FP8 weights with dynamic per-token activations (as `quantization="fp8"` loads them): the norms and the
    SwiGLU emit quantized rows, o_proj's input is quantized by the one launch, every step's rows (up to
    GEMM_ROWS) go through the Triton FP8 matmul; the logits equal the torch references' (which quantize each
    layer's input themselves) up to an activation that lands one E4M3 step apart when a kernel's float32
    rounding differs by an ulp."""
    online = Fp8Scheme("channel", "token", online=True)
    model = tiny_model(2, seed=3, quant=Quantization("fp8", {n: online for n in linear_layers(2, False)}))
    assert model.layers[0].input_layernorm.fp8 and model.layers[1].mlp.fp8 and not model.norm.fp8
    calls: dict[str, list[int]] = {}
    for module, name in [(kernels, n) for n in ("rms_norm_fp8", "silu_and_mul_fp8", "quantize_fp8")] + [
        (importlib.import_module("tinypaged.kernels.fp8_gemm"), "fp8_gemm")
    ]:
        kernel = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, k=kernel, n=name: calls.setdefault(n, []).append(1) or k(*a)
        )
    prompts = [[5, 17, 3, 96, 40, 2, 7], [11, 12]]
    decodes = [[8, 9], [1, 2]]
    got = run_paged(model, prompts, 8, decodes)
    steps = 1 + len(decodes[0])  # the prefill, then each decode step
    assert {n: len(c) for n, c in calls.items()} == {
        "rms_norm_fp8": 2 * 2 * steps,
        "silu_and_mul_fp8": 2 * steps,
        "quantize_fp8": 2 * steps,
        "fp8_gemm": 4 * 2 * steps,
    }
    with ops.torch_reference_ops():
        want = run_paged(model, prompts, 8, decodes)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-2 * w.abs().max().item(), rtol=0)
