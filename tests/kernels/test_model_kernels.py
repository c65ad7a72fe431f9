"""The model's forward pass through the Triton kernels (interpreter) against the torch references, on a tiny random
Llama: a ragged prefill, then decode steps, with the staging's launch hints (so that decode steps take the decode
kernels' path, as the engine's do); dense, with FP8 weights (the activations quantized by the kernels that
produce them), and with weight-only INT4 / INT8 weights."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from tinypaged import kernels, ops
from tinypaged.config import ModelConfig
from tinypaged.model.llama import LlamaForCausalLM
from tinypaged.model.quant import Linear, fp8, lowbit
from tinypaged.quantization import ONLINE_INT, Fp8Scheme, Quantization, linear_layers


def tiny_model(
    num_kv_heads: int, seed: int, quant: Quantization | None = None, **family: object
) -> LlamaForCausalLM:
    """Two layers of GQA (4 query heads) with random weights and norms, float32 (FP8 linear layers as `quant`
    says: E4M3 weights with per-row scales, quantized from random ones); `family`: ModelConfig's family
    fields."""
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
        **family,
    )
    model = LlamaForCausalLM(cfg, max_positions=128, quant=quant)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for layer in model.modules():
            if (
                isinstance(layer, Linear)
                and getattr(layer, "weight", None) is not None
                and layer.weight.dtype == fp8.FP8_DTYPE
            ):
                q, scale = fp8.quantize_per_channel(torch.randn(layer.weight.shape, generator=gen) * 0.3)
                layer.weight.copy_(q)
                layer.weight_scale.copy_(scale)
            if isinstance(layer, Linear) and hasattr(layer, "qweight"):
                w = torch.randn(layer.out_features, layer.in_features, generator=gen) * 0.3
                q = lowbit.quantize_rtn(w, layer.method.scheme.bits, layer.group, layer.zeros is None)
                for name in ("qweight", "scales", "zeros"):
                    if getattr(q, name) is not None:
                        getattr(layer, name).copy_(getattr(q, name))
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


@pytest.mark.parametrize(
    "family",
    [
        dict(family="gemma3", qk_norm=True, hidden_act="gelu_pytorch_tanh", layer_windows=(6, None)),
        dict(family="qwen2", qkv_bias=True, layer_windows=(5, 5)),
    ],
)
def test_family_switches_equal_the_references(family: dict, run_paged) -> None:
    """Gemma 3's q/k norms, GELU-tanh gate, sandwich norms and interleaved windows; Qwen's q/k/v biases under a
    window on every layer: the kernels' model equals the torch references' past the windows."""
    model = tiny_model(2, seed=5, local_rope_theta=100.0 if family["family"] == "gemma3" else None, **family)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 17, 1)]
    decodes = [torch.randint(0, 97, (4,), generator=gen).tolist() for _ in prompts]
    got = run_paged(model, prompts, 4, decodes)
    with ops.torch_reference_ops():
        want = run_paged(model, prompts, 4, decodes)
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


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_int_model_equals_the_references(
    quantization: str, run_paged, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weight-only INT4 (zero points) and INT8 (symmetric) layers, groups of 64 and 32 columns: a 79-row
    prefill dequantizes for the matmul, a 9-row one takes the tensor-core kernel, decode steps and a 2-row
    prefill the GEMV; the logits equal the references' (float32 products of the same codes) up to float32
    sums."""
    from tinypaged.kernels import lowbit as int_kernels

    scheme = ONLINE_INT[quantization]
    model = tiny_model(
        2, seed=4, quant=Quantization(quantization, {n: scheme for n in linear_layers(2, False)})
    )
    calls: dict[str, int] = {}
    for name in ("wint_gemv", "wint_gemm", "wint_dequantize"):
        kernel = getattr(int_kernels, name)
        monkeypatch.setattr(
            int_kernels, name, lambda *a, k=kernel, n=name: calls.__setitem__(n, calls.get(n, 0) + 1) or k(*a)
        )
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (70, 9)]
    decodes = [[8, 9], [1, 2]]
    got = run_paged(model, prompts, 8, [[], []])
    got += run_paged(model, prompts[1:], 8, decodes[1:]) + run_paged(model, [[3, 4]], 8, decodes[:1])
    layers = 4 * 2
    # 79 rows, then 9, then 1 and 1; then 2 (a prefill), 1 and 1.
    assert calls == {"wint_dequantize": layers, "wint_gemm": layers, "wint_gemv": layers * 5}
    with ops.torch_reference_ops():
        want = run_paged(model, prompts, 8, [[], []])
        want += run_paged(model, prompts[1:], 8, decodes[1:]) + run_paged(model, [[3, 4]], 8, decodes[:1])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
