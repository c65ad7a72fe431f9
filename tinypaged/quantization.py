"""Which quantization each linear layer runs: a checkpoint's `quantization_config` (or the `quantization` engine
argument) read into one small scheme per layer, or refused in one line naming the scheme and the layer.

Plain data and no torch: `EngineConfig` resolves it before any weight is read, and `model/quant/linear.py` turns
each scheme into the linear method that stores and applies the layer's weight. The formats are read here, by the
engine itself (no compressed-tensors import):
- compressed-tensors as llm-compressor writes it (`quant_method: compressed-tensors`, `config_groups` of
  `targets` / `weights` / `input_activations`, an `ignore` list, `format: float-quantized`);
- FP8 as Qwen3 and DeepSeek publish it (`quant_method: fp8`, `weight_block_size`, `weight_scale_inv`), and the
  same method without blocks (per-tensor `weight_scale`, `activation_scheme` dynamic or static);
- `quantization="fp8"` on a full-precision checkpoint: quantized at load, per output channel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tinypaged.errors import ConfigError

# The checkpoint's linear layers of a decoder layer, and the ones tinypaged fuses into one matmul (they must
# share a scheme: one weight, one activation quantization).
LAYER_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
FUSED_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.gate_proj", "mlp.up_proj"),
)

QUANTIZATIONS = ("fp8",)  # the `quantization` engine argument's values (vLLM's names)
_RUNS = (
    "tinypaged runs FP8 E4M3 weights with per-tensor, per-channel or block scales, and FP8 activations "
    "(dynamic per token, static per tensor, or none)"
)


@dataclass(frozen=True)
class Fp8Scheme:
    """E4M3 weights with float32 scales, and how the layer's input is quantized."""

    weights: str  # "tensor" | "channel" | "block": one scale per tensor, per output row, per block
    activations: str | None  # "token" (dynamic, per row), "group" (dynamic, per row and block of
    # columns), "static" (the checkpoint's per-tensor `input_scale`); None: not quantized (W8A16)
    block: tuple[int, int] | None = None  # (rows, columns) of a weight block, for "block"
    scale_name: str = "weight_scale"  # the checkpoint's name of the weight scales
    online: bool = False  # the checkpoint is full precision; quantized at load (per output channel)

    def __str__(self) -> str:
        w = f"block {self.block[0]}x{self.block[1]}" if self.block else self.weights
        a = {"token": "dynamic per-token", "group": "dynamic per-token-group", "static": "static per-tensor"}
        return f"fp8 ({w} weights, {a.get(self.activations or '', 'unquantized')} activations)"


Scheme = Fp8Scheme  # issue 38 adds integer weight-only schemes beside it


@dataclass(frozen=True)
class Quantization:
    """The scheme of every quantized linear layer, by its checkpoint module name (absent: unquantized)."""

    method: str  # "compressed-tensors", "fp8": the checkpoint's quant_method (or the requested one)
    layers: dict[str, Scheme]

    def scheme(self, layer: str) -> Scheme | None:
        """The scheme of checkpoint module `layer` (e.g. `model.layers.0.self_attn.q_proj`), None if dense."""
        return self.layers.get(layer)


def linear_layers(num_layers: int, lm_head: bool) -> list[str]:
    """The checkpoint module names of a model's linear layers (and its LM head, when it has its own)."""
    names = [f"model.layers.{i}.{m}" for i in range(num_layers) for m in LAYER_LINEARS]
    return names + (["lm_head"] if lm_head else [])


def resolve_quantization(
    raw: dict[str, Any] | None, requested: str | None, where: str, num_layers: int, lm_head: bool
) -> Quantization | None:
    """Each linear layer's scheme from a checkpoint's `quantization_config` (`raw`) and the `quantization`
    argument (None: as the checkpoint says); ConfigError naming the scheme and the first layer it cannot run.
    `where` names the checkpoint; the model has `num_layers` decoder layers and maybe an LM head of its own."""
    layer_names = linear_layers(num_layers, lm_head)
    if requested is not None and requested not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {requested!r}")
    if raw is None:
        if requested is None:
            return None
        online = Fp8Scheme("channel", "token", online=True)
        return Quantization("fp8", {n: online for n in layer_names if n != "lm_head"})
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: quantization_config must be an object, got {type(raw).__name__}")
    method = str(raw.get("quant_method", "")).lower()
    if requested is not None and method != requested:
        raise ConfigError(
            f"{where}: quantization {requested!r} was asked for, but the checkpoint is already quantized with "
            f"{method!r}: leave quantization unset to run it as it is"
        )
    reader = {"compressed-tensors": _compressed_tensors, "fp8": _fp8}.get(method)
    if reader is None:
        raise ConfigError(
            f"{where}: layer {layer_names[0]}: quant_method {method or None!r} is not run by tinypaged "
            f"(it reads compressed-tensors and fp8 checkpoints; {_RUNS})"
        )
    layers = {}
    for layer in layer_names:
        scheme = reader(raw, layer, where)
        if scheme is not None:
            if layer == "lm_head":
                raise ConfigError(
                    f"{where}: layer lm_head is quantized ({scheme}); tinypaged keeps the LM head in the "
                    "model's dtype (list it in the checkpoint's ignore list)"
                )
            layers[layer] = scheme
    for i in range(num_layers):
        for group in FUSED_GROUPS:
            found = {layers.get(f"model.layers.{i}.{m}") for m in group}
            if len(found) > 1:
                raise ConfigError(
                    f"{where}: layer model.layers.{i}: {', '.join(group)} are quantized differently "
                    f"({', '.join(sorted(map(str, found)))}); tinypaged runs them as one matmul"
                )
    return Quantization(method, layers)


# ---- compressed-tensors ---------------------------------------------------------------------------------------


def _matches(layer: str, targets: list[str]) -> bool:
    """compressed-tensors' matching of a Linear module: by class name, `re:` regex (re.match) or exact name."""
    return any(
        t == "Linear" or t == layer or (t.startswith("re:") and re.match(t[3:], layer) is not None)
        for t in targets
    )


def _compressed_tensors(raw: dict[str, Any], layer: str, where: str) -> Scheme | None:
    """The scheme of `layer` in a compressed-tensors config: the first config group that targets it, unless
    it is ignored."""
    for key in ("sparsity_config", "transform_config"):
        if raw.get(key):
            raise ConfigError(f"{where}: layer {layer}: compressed-tensors {key} is not run by tinypaged")
    _check_kv_cache_scheme(raw.get("kv_cache_scheme"), where)
    if _matches(layer, raw.get("ignore") or []):
        return None
    for group in (raw.get("config_groups") or {}).values():
        if _matches(layer, group.get("targets") or []):
            return _ct_scheme(group, group.get("format") or raw.get("format"), layer, where)
    return None


def _check_kv_cache_scheme(kv: dict[str, Any] | None, where: str) -> None:
    """A compressed-tensors `kv_cache_scheme` must be what the FP8 KV cache runs: E4M3 with one static
    symmetric scale per layer for keys and one for values (its `k_scale` / `v_scale`, read with
    `kv_cache_dtype="fp8"`; with "auto" the cache keeps the model's dtype and they are not read)."""
    if not kv:
        return
    fp8_tensor = (
        kv.get("num_bits") == 8
        and kv.get("type") == "float"
        and kv.get("strategy", "tensor") == "tensor"
        and not kv.get("dynamic")
        and kv.get("symmetric", True)
    )
    if not fp8_tensor:
        raise ConfigError(
            f"{where}: compressed-tensors kv_cache_scheme {kv} is not run by tinypaged: its FP8 KV cache takes "
            "one static symmetric E4M3 scale per layer for keys and one for values (num_bits 8, type float, "
            "strategy tensor)"
        )


def _ct_describe(w: dict | None, a: dict | None) -> str:
    """A compressed-tensors scheme in words, e.g. `NVFP4 (weights float4 tensor_group 16, activations ...)`."""

    def part(q: dict | None) -> str:
        if not q:
            return "none"
        kind = "float" if q.get("type") == "float" else "int"
        group = f" {q['group_size']}" if q.get("group_size") else ""
        dyn = " dynamic" if q.get("dynamic") else ""
        return f"{kind}{q.get('num_bits')} {q.get('strategy')}{group}{dyn}"

    wb, ab = (w or {}).get("num_bits", 16), (a or {}).get("num_bits", 16)
    name = f"W{wb}A{ab}"
    if w and w.get("type") == "float" and wb == 4:
        name = "NVFP4" if w.get("group_size") == 16 else "MXFP4" if w.get("group_size") == 32 else "FP4"
    elif w and w.get("type") == "float" and wb == 8:
        name = "FP8"
    return f"{name} (weights {part(w)}, activations {part(a)})"


def _ct_scheme(group: dict[str, Any], fmt: str | None, layer: str, where: str) -> Scheme:
    """The FP8 scheme of one compressed-tensors config group, or ConfigError."""
    w, a = group.get("weights"), group.get("input_activations")

    def refuse(why: str = "") -> ConfigError:
        return ConfigError(
            f"{where}: layer {layer} uses the compressed-tensors scheme {_ct_describe(w, a)}, which tinypaged "
            f"does not run{why} ({_RUNS})"
        )

    if group.get("output_activations"):
        raise refuse(" (output activations are quantized)")
    if not w or w.get("type") != "float" or w.get("num_bits") != 8:
        raise refuse()
    if not w.get("symmetric", True) or w.get("dynamic"):
        raise refuse(" (asymmetric or dynamic weights)")
    if fmt not in ("float-quantized", None):
        raise refuse(f" (format {fmt!r}; FP8 weights are read in format float-quantized)")
    strategy = w.get("strategy")
    block = None
    if strategy == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
            raise refuse(f" (block_structure {bs!r})")
        block = (bs[0], bs[1])
    elif strategy not in ("tensor", "channel"):
        raise refuse(f" (weight strategy {strategy!r})")
    if a is None:
        acts = None
    elif a.get("type") != "float" or a.get("num_bits") != 8 or not a.get("symmetric", True):
        raise refuse()
    elif a.get("dynamic") is True and a.get("strategy") in ("token", "tensor"):
        # Dynamic per-tensor activations are run per token: finer, and a row's result does not depend on
        # what else is in the batch (docs/quantization.md).
        acts = "token"
    elif (
        a.get("dynamic") is True
        and a.get("strategy") == "group"
        and block
        and a.get("group_size") == block[1]
    ):
        acts = "group"
    elif a.get("dynamic") is False and a.get("strategy") == "tensor":
        acts = "static"
    else:
        raise refuse(" (activation strategy)")
    return Fp8Scheme(strategy, acts, block)


# ---- quant_method fp8 (Qwen3, DeepSeek; vLLM's Fp8Config) -------------------------------------------------------


def _fp8(raw: dict[str, Any], layer: str, where: str) -> Scheme | None:
    """The scheme of `layer` in a `quant_method: fp8` config (None: in its list of layers left unquantized)."""
    skipped = raw.get("ignored_layers") or raw.get("modules_to_not_convert") or []
    # vLLM and transformers match these as prefixes / substrings of the module name.
    if any(s and (s in layer or layer.startswith(s)) for s in skipped):
        return None
    fmt, act = raw.get("fmt", "e4m3"), raw.get("activation_scheme", "dynamic")
    block = raw.get("weight_block_size")
    desc = f"fp8 (fmt {fmt}, activation_scheme {act}, weight_block_size {block})"

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"{where}: layer {layer} uses {desc}, which tinypaged does not run: {why}")

    if fmt != "e4m3":
        raise refuse("only E4M3 weights are run")
    if act not in ("dynamic", "static"):
        raise refuse("activation_scheme must be dynamic or static")
    if block is None:
        return Fp8Scheme("tensor", "token" if act == "dynamic" else "static")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise refuse("weight_block_size must be two positive integers")
    if act != "dynamic":
        raise refuse("block-scaled weights take dynamic activations")
    return Fp8Scheme("block", "group", (block[0], block[1]), scale_name="weight_scale_inv")
