"""The KV cache's dtype, and an FP8 cache's scales: the checkpoint's where it has them, else calibrated at startup.

An FP8 (E4M3) cache stores `fp8(x / scale)` with one float32 scale per layer for keys and one for values
(vLLM's `k_scale` / `v_scale`). E4M3 keeps 3 mantissa bits from 2^-6 to 448, so a scale decides where a layer's
values fall in that range (past it they saturate, below it they lose bits), not their precision within it.
vLLM's default, 1.0, fits most layers but not all: on the default model 42% of the first layer's values lie
below 2^-6, and a model whose keys pass 448 would saturate. So without checkpoint scales each layer's are
measured once at startup: a short built-in text (and a chat exchange, when the model has a template) is
prefilled into a scratch cache in the model's dtype, and a layer's scale is the smallest power of two that
stores HEADROOM times the largest magnitude seen there without saturating. A power of two, because then the
stored value is exactly x's own E4M3 rounding, as with 1.0 (and the kernels' folding of the scale is exact):
on the default model non-power-of-two scales (amax x 1, 4 or 16 / 448) cost 1.8-2.0% of perplexity against
f32, 1.0 and these 1.3-1.4% (benchmarks/HISTORY.md, "The FP8 KV cache's accuracy cost").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tinypaged.config import EngineConfig
from tinypaged.errors import ConfigError
from tinypaged.model import LlamaForCausalLM
from tinypaged.model.loader import kv_cache_scales
from tinypaged.model.parallel import TPGroup
from tinypaged.model.quant.e4m3 import FP8_DTYPE, FP8_MAX
from tinypaged.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Compute capability from which CUDA devices convert to and from E4M3 natively (Ada, Hopper and later).
FP8_MIN_CAPABILITY = (8, 9)
# How far past the calibration's largest magnitude a layer's keys or values may go before they saturate.
HEADROOM = 2.0

CALIBRATION_TEXT = """\
The old lighthouse keeper climbed the spiral stairs every evening at six, counting the steps (there were 143) \
and listening to the wind. In the logbook he wrote the date, the weather and the ships he had seen: "March 14: \
fog until noon, then clear; two trawlers and a ferry." Nobody read the logbook, but he kept it anyway.

To compute the mean of a list in Python, write:

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

Photosynthesis turns light, water and carbon dioxide into glucose and oxygen. A single mature tree can absorb \
about 22 kilograms of CO2 a year, although the figure varies widely with species, age and climate.

Q: What is the capital of Australia?
A: Canberra, not Sydney, as many people guess.

1. Preheat the oven to 200 degrees.
2. Mix the flour, the butter and a pinch of salt.
3. Bake for 25 minutes, until golden."""

CALIBRATION_CHAT = [
    {"role": "user", "content": "Explain in two sentences why the sky is blue."},
    {
        "role": "assistant",
        "content": "Sunlight is scattered by the molecules of the air, and blue light, with its shorter "
        "wavelength, is scattered far more than red. So wherever we look away from the sun, the sky sends us "
        "mostly blue light.",
    },
]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`kv_cache_dtype` as a torch dtype: "auto" is the model's; "fp8" / "fp8_e4m3" is E4M3, refused on a CUDA
    device that has no FP8 (the CPU emulates it exactly)."""
    if name == "auto":
        return model_dtype
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            raise ConfigError(
                f"kv_cache_dtype {name} needs a GPU with FP8 (compute capability 8.9 or later), but {device} "
                f"({torch.cuda.get_device_name(device)}) is {capability[0]}.{capability[1]}; use kv_cache_dtype auto"
            )
    return FP8_DTYPE


def calibration_prompts(config: EngineConfig) -> list[list[int]]:
    """The token ids the scales are measured on: the built-in text, and a chat exchange in the model's template
    (whose special tokens are how served chats start)."""
    tokenizer = Tokenizer(config.tokenizer_path)
    prompts = [tokenizer.encode(CALIBRATION_TEXT)]
    if tokenizer.chat_template:
        chat = tokenizer.apply_chat_template(CALIBRATION_CHAT, add_generation_prompt=False)
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    assert config.max_model_len is not None
    return [p[: config.max_model_len] for p in prompts]


def calibrated_scales(kv: torch.Tensor, tp: TPGroup) -> list[tuple[float, float]]:
    """Each layer's (k_scale, v_scale) from a scratch cache `[layers, 2, blocks, ...]` that holds the calibration
    prompts' keys and values (zeros elsewhere): HEADROOM x the largest magnitude / 448, the largest over the
    tensor-parallel ranks (each holds its own KV heads), so that every rank stores with the same scales."""
    amax = kv.float().abs().amax(dim=(2, 3, 4, 5))  # [layers, 2]
    if tp.size > 1:
        amax = tp.gather_columns(amax.reshape(1, -1)).view(tp.size, *amax.shape).amax(0)
    # The smallest power of two that stores HEADROOM x amax without saturating (1.0 for an all-zero layer).
    scales = torch.exp2(torch.ceil(torch.log2(amax * HEADROOM / FP8_MAX))).where(amax > 0, 1.0).tolist()
    return [(k, v) for k, v in scales]


def set_kv_scales(
    model: LlamaForCausalLM,
    config: EngineConfig,
    kv_dtype: torch.dtype,
    tp: TPGroup,
    prefill: Callable[[list[list[int]]], torch.Tensor],
) -> str:
    """Give every attention layer its `k_scale` and `v_scale` for a cache of `kv_dtype` and say where they came
    from: the checkpoint's, calibrated (`prefill(prompts)` returns a scratch cache in the model's dtype that
    holds their keys and values), or 1.0. `config.calculate_kv_scales` (vLLM's flag): True calibrates even over
    the checkpoint's; False takes the checkpoint's, else 1.0 (vLLM's default); None the checkpoint's, else
    calibrates. Only an FP8 cache has scales; any other keeps 1.0, which nothing reads."""
    if kv_dtype != FP8_DTYPE:
        return "none"
    calculate = config.calculate_kv_scales
    scales = None if calculate else kv_cache_scales(config.model_config)
    source = "checkpoint"
    if scales is None and calculate is False:
        scales, source = [(1.0, 1.0)] * len(model.layers), "1.0"
    elif scales is None:
        scales = calibrated_scales(prefill(calibration_prompts(config)), tp)
        source = "calibrated"
    for layer, (k_scale, v_scale) in zip(model.layers, scales, strict=True):
        layer.self_attn.k_scale, layer.self_attn.v_scale = k_scale, v_scale
    logger.info(
        "FP8 KV cache scales (%s): k %.3g-%.3g, v %.3g-%.3g",
        source,
        min(k for k, _ in scales),
        max(k for k, _ in scales),
        min(v for _, v in scales),
        max(v for _, v in scales),
    )
    return source
