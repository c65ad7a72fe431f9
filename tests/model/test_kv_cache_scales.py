"""A checkpoint's FP8 KV-cache scales: compressed-tensors' `kv_cache_scheme` (its config written by
compressed-tensors itself) with a `k_scale` and `v_scale` a layer, as llm-compressor saves them on each attention
module, reach the attention layers with `kv_cache_dtype="fp8"`; other KV schemes and malformed scales are
refused in one line; a checkpoint without scales is calibrated."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinypaged.config import ConfigError, EngineConfig
from tinypaged.engine.device.model_runner import ModelRunner
from tinypaged.weights.random_model import make_random_model

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import KVCacheScaleType, QuantizationArgs, QuantizationConfig  # noqa: E402

FP8_KV = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
SCALES = [(0.031, 0.0125), (0.047, 0.0078)]


def _checkpoint(
    tmp: Path, scales: dict[str, torch.Tensor] | None, kv_scheme: QuantizationArgs | None
) -> Path:
    """A tiny random Llama (2 layers, the default model's tokenizer) with KV-cache scales added as compressed-tensors
    names them on each attention module, and compressed-tensors' own config for a KV-only scheme."""
    shape = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}
    shape |= {"num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256}
    path = make_random_model("smollm2-135m", tmp / "ckpt", overrides=shape)
    if scales is not None:
        tensors = load_file(path / "model.safetensors") | scales
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if kv_scheme is not None:
        qc = QuantizationConfig(config_groups={}, kv_cache_scheme=kv_scheme, format="float-quantized")
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = qc.model_dump() | {"quant_method": "compressed-tensors"}
        (path / "config.json").write_text(json.dumps(config))
    return path


def _scales(values: list[tuple[float, float]], shape: tuple[int, ...] = (1,)) -> dict[str, torch.Tensor]:
    out = {}
    for i, pair in enumerate(values):
        for kind, value in zip((KVCacheScaleType.KEY, KVCacheScaleType.VALUE), pair, strict=True):
            out[f"model.layers.{i}.self_attn.{kind.value}"] = torch.full(shape, value)
    return out


def _runner(path: Path, kv_cache_dtype: str, calculate_kv_scales: bool | None = None) -> ModelRunner:
    return ModelRunner(
        EngineConfig(
            model=path,
            kv_cache_dtype=kv_cache_dtype,
            calculate_kv_scales=calculate_kv_scales,
            max_model_len=64,
            swap_space=0.01,
            cpu_kv_cache_space=0.01,
        )
    )


def _layer_scales(runner: ModelRunner) -> list[tuple[float, float]]:
    return [(a.k_scale, a.v_scale) for a in (layer.self_attn for layer in runner.model.layers)]


def test_checkpoint_scales_reach_the_attention_layers(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, _scales(SCALES), FP8_KV)
    runner = _runner(path, "fp8")
    assert runner.stats.kv_scales == "checkpoint"
    got = [(a.k_scale, a.v_scale) for a in (layer.self_attn for layer in runner.model.layers)]
    assert got == [(torch.tensor(k).item(), torch.tensor(v).item()) for k, v in SCALES]  # float32 values
    # With the model's dtype the cache has no scales: the checkpoint's are not read.
    plain = _runner(path, "auto")
    assert plain.stats.kv_scales == "none" and plain.model.layers[0].self_attn.k_scale == 1.0


def test_a_layer_without_scales_is_refused(tmp_path: Path) -> None:
    scales = _scales(SCALES)
    del scales["model.layers.1.self_attn.v_scale"]
    with pytest.raises(ConfigError, match="lacks 1, e.g. v_scale of layer 1"):
        _runner(_checkpoint(tmp_path, scales, FP8_KV), "fp8")


def test_per_head_scales_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"must be one positive number .* per-head scales are not run"):
        _runner(_checkpoint(tmp_path, _scales(SCALES, shape=(2, 1, 1)), FP8_KV), "fp8")


@pytest.mark.parametrize(
    "scheme",
    [
        QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True),
        QuantizationArgs(num_bits=8, type="float", strategy="attn_head", symmetric=True),
        QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=True, symmetric=True),
    ],
)
def test_other_kv_cache_schemes_are_refused_before_loading(tmp_path: Path, scheme: QuantizationArgs) -> None:
    path = _checkpoint(tmp_path, None, scheme)
    with pytest.raises(
        ConfigError, match="kv_cache_scheme .* is not run by tinypaged: its FP8 KV cache takes"
    ):
        EngineConfig(model=path)


def test_without_scales_they_are_calibrated(tmp_path: Path, model_dir: Path) -> None:
    """The calibration prefill runs on the model's own tokenizer: each layer's scale is the smallest power of two
    that stores HEADROOM times its largest key (value)."""
    runner = _runner(_checkpoint(tmp_path, None, None), "fp8")
    assert runner.stats.kv_scales == "calibrated"
    scales = [s for layer in runner.model.layers for s in (layer.self_attn.k_scale, layer.self_attn.v_scale)]
    assert all(0 < s < 1 and math.log2(s).is_integer() for s in scales), scales


def test_vllm_s_calculate_kv_scales(tmp_path: Path) -> None:
    """On: calibrated over the checkpoint's scales; off: the checkpoint's, else vLLM's default 1.0."""
    with_scales = _checkpoint(tmp_path / "a", _scales(SCALES), FP8_KV)
    on = _runner(with_scales, "fp8", True)
    assert on.stats.kv_scales == "calibrated"
    assert all(math.log2(s).is_integer() for pair in _layer_scales(on) for s in pair)
    off = _runner(with_scales, "fp8", False)
    assert off.stats.kv_scales == "checkpoint"
    assert _layer_scales(off) == [(torch.tensor(k).item(), torch.tensor(v).item()) for k, v in SCALES]
    bare = _runner(_checkpoint(tmp_path / "b", None, None), "fp8", False)
    assert bare.stats.kv_scales == "1.0" and _layer_scales(bare) == [(1.0, 1.0)] * 2
