"""Which quantization each linear layer runs: a checkpoint's `quantization_config` (or the `quantization` engine
argument) read into one small scheme per layer, or refused in one line naming the scheme and the layer.

Plain data and no torch: `EngineConfig` resolves it before any weight is read, and `model/quant/linear.py` turns
each scheme into the linear method that stores and applies the layer's weight. The formats are read here, by the
engine itself (no compressed-tensors import):
- compressed-tensors as llm-compressor writes it (`quant_method: compressed-tensors`, `config_groups` of
  `targets` / `weights` / `input_activations`, an `ignore` list, `format: float-quantized`);
- FP8 as Qwen3 and DeepSeek publish it (`quant_method: fp8`, `weight_block_size`, `weight_scale_inv`), and the
  same method without blocks (per-tensor `weight_scale`, `activation_scheme` dynamic or static);
- `quantization="fp8"` on a full-precision checkpoint: quantized at load, per output channel;
- weight-only INT4 / INT8 (`IntScheme`): compressed-tensors W4A16 / W8A16 in `format: pack-quantized`, GPTQ
  (`quant_method: gptq`) and AWQ (`quant_method: awq`, GEMM packing), and `quantization="int4"` / `"int8"` on
  a full-precision checkpoint (round to nearest at load, groups of 128 columns); GGUF blocks kept quantized
  (`quant_method: gguf`, written by weights/gguf_convert.py: each layer's GGUF type under `layers`; fused parts
  of different types, as a Q4_K_M file's Q4_K q and k with a Q6_K v, under one name such as "Q4_K+Q6_K").

One job: each format's description of its quantization read into the same small schemes, with the same checks
(fused parts share a scheme, the LM head stays dense) and the same one-line refusals; the readers are short and
share those, so they stay together (the issue that built them asked for one place).
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

# The `quantization` engine argument's values (vLLM's names): fp8, int4 and int8 quantize a full-precision
# checkpoint at load; FORMATS name an already quantized checkpoint's format, which it must then have;
# ALIASES are vLLM's other names of those formats (its Marlin kernels', compressed-tensors' Python spelling).
QUANTIZATIONS = ("fp8", "int4", "int8", "gguf", "compressed-tensors", "gptq", "awq")
FORMATS = ("gguf", "compressed-tensors", "gptq", "awq")
ALIASES = {"compressed_tensors": "compressed-tensors", "gptq_marlin": "gptq", "awq_marlin": "awq"}
_RUNS = (
    "tinypaged runs FP8 E4M3 weights with per-tensor, per-channel or block scales, and FP8 activations "
    "(dynamic per token, static per tensor, or none); and weight-only INT4 / INT8 in groups or per channel, "
    "symmetric or with zero points (compressed-tensors pack-quantized, GPTQ, AWQ)"
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


@dataclass(frozen=True)
class IntScheme:
    """Weight-only integer codes (activations stay in the model's dtype), as `format` stores them."""

    bits: int  # 4 | 8
    group: int | None  # input columns per scale; None: one scale per output row (per channel)
    zero_points: bool  # a zero point per group (asymmetric); else 2^(bits - 1)
    # "pack-quantized" (compressed-tensors), "gptq", "gptq_v2" (zero points stored as they are), "awq",
    # "online" (a full-precision checkpoint, rounded to nearest at load), "gguf" (GGUF blocks repacked)
    format: str
    mins: bool = False  # a float32 offset per group, the zero point 0 (GGUF's `q * d + m` types)

    def __str__(self) -> str:
        group = f"group {self.group}" if self.group else "per channel"
        zeros = "with mins" if self.mins else "asymmetric" if self.zero_points else "symmetric"
        return f"int{self.bits} weight-only ({group}, {zeros}, {self.format})"


Scheme = Fp8Scheme | IntScheme
# What `quantization="int4"` / `"int8"` rounds a full-precision checkpoint to: groups of 128 columns (64 or 32
# where 128 does not divide a layer's input), INT4 with zero points (as AWQ and GPTQ default to), INT8 symmetric.
ONLINE_INT = {
    "int4": IntScheme(4, 128, True, "online"),
    "int8": IntScheme(8, 128, False, "online"),
}


def canonical_quantization(name: str) -> str:
    """A `quantization` (or a checkpoint's `quant_method`) lower-cased, as vLLM reads it, its alias resolved."""
    return ALIASES.get(name.lower(), name.lower())


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
    requested = canonical_quantization(requested) if isinstance(requested, str) else requested
    if requested is not None and requested not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {requested!r}")
    if raw is None:
        if requested is None:
            return None
        if requested in FORMATS:
            fix = "pass the .gguf file" if requested == "gguf" else "int4, int8 or fp8 quantize one at load"
            raise ConfigError(
                f"{where}: quantization {requested!r} runs a checkpoint quantized in that format, and this one "
                f"has no quantization_config ({fix})"
            )
        online = ONLINE_INT.get(requested) or Fp8Scheme("channel", "token", online=True)
        return Quantization(requested, {n: online for n in layer_names if n != "lm_head"})
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: quantization_config must be an object, got {type(raw).__name__}")
    method = canonical_quantization(str(raw.get("quant_method", "")))
    if requested is not None and method != requested:
        raise ConfigError(
            f"{where}: quantization {requested!r} was asked for, but the checkpoint is already quantized with "
            f"{method!r}: leave quantization unset to run it as it is"
        )
    readers = {
        "compressed-tensors": _compressed_tensors,
        "fp8": _fp8,
        "gptq": _gptq,
        "awq": _awq,
        "gguf": _gguf,
    }
    reader = readers.get(method)
    if reader is None:
        raise ConfigError(
            f"{where}: layer {layer_names[0]}: quant_method {method or None!r} is not run by tinypaged "
            f"(it reads compressed-tensors, fp8, gptq and awq checkpoints; {_RUNS})"
        )
    layers = {}
    for layer in layer_names:
        try:
            scheme = reader(raw, layer, where)
        except ConfigError:
            raise
        except (AttributeError, TypeError, KeyError, ValueError) as e:  # a field of the wrong JSON type
            raise ConfigError(
                f"{where}: layer {layer}: quantization_config ({method}) is malformed: {type(e).__name__}: {e}"
            ) from e
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
    if w and w.get("type") == "int" and a is None:
        return _ct_int_scheme(w, fmt, refuse)
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


def _ct_int_scheme(w: dict[str, Any], fmt: str | None, refuse: Any) -> IntScheme:
    """The scheme of compressed-tensors integer weights without quantized activations (W4A16, W8A16)."""
    if fmt != "pack-quantized":
        raise refuse(f" (format {fmt!r}; integer weights are read in format pack-quantized)")
    if w.get("num_bits") not in (4, 8) or w.get("dynamic"):
        raise refuse(" (integer weights of 4 or 8 bits, static, are run)")
    if w.get("actorder") not in (None, "weight", "static"):
        # "group" stores a g_idx: groups that are not runs of consecutive columns.
        raise refuse(f" (actorder {w.get('actorder')!r}: act-order groups are not run; quantize without it)")
    strategy = w.get("strategy")
    if strategy == "channel":
        return IntScheme(w["num_bits"], None, not w.get("symmetric", True), "pack-quantized")
    size = w.get("group_size")
    if strategy != "group" or not isinstance(size, int) or size <= 0 or size % 32:
        raise refuse(
            f" (weight strategy {strategy!r}, group size {size!r}: groups are a multiple of 32 columns)"
        )
    return IntScheme(w["num_bits"], size, not w.get("symmetric", True), "pack-quantized")


# ---- GPTQ and AWQ (AutoGPTQ / GPTQModel, AutoAWQ; transformers' GPTQConfig and AwqConfig) -----------------


def _skipped(raw: dict[str, Any], layer: str) -> bool:
    """Whether `layer` is left unquantized: `modules_to_not_convert` (substrings or prefixes, as transformers
    matches them), or not among GPTQ's `modules_in_block_to_quantize`."""
    if any(s and (s in layer or layer.startswith(s)) for s in raw.get("modules_to_not_convert") or []):
        return True
    blocks = raw.get("modules_in_block_to_quantize")
    if blocks:
        names = [n for b in blocks for n in (b if isinstance(b, list) else [b])]
        return not any(layer.endswith("." + n) for n in names)
    return layer == "lm_head" and not raw.get("lm_head")


def _group(size: Any, refuse: Any) -> int | None:
    if size in (-1, None):
        return None
    if not isinstance(size, int) or size <= 0 or size % 32:
        raise refuse(f"group_size {size!r}: groups are a multiple of 32 columns, or -1 (per channel)")
    return size


def _gptq(raw: dict[str, Any], layer: str, where: str) -> Scheme | None:
    """The scheme of `layer` in a GPTQ config (None: left unquantized)."""
    if _skipped(raw, layer):
        return None
    bits, fmt = raw.get("bits"), raw.get("checkpoint_format", "gptq")
    desc = f"gptq (bits {bits}, group_size {raw.get('group_size')}, desc_act {raw.get('desc_act')}, {fmt})"

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"{where}: layer {layer} uses {desc}, which tinypaged does not run: {why}")

    if bits not in (4, 8):
        raise refuse("4- and 8-bit codes are run")
    if raw.get("desc_act"):
        raise refuse("act-order (desc_act) groups are not run; quantize with desc_act false")
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse(f"checkpoint_format {fmt!r} (gptq and gptq_v2 are read)")
    if raw.get("dynamic"):
        raise refuse("per-module overrides (dynamic) are not run")
    return IntScheme(bits, _group(raw.get("group_size", 128), refuse), True, fmt)


def _awq(raw: dict[str, Any], layer: str, where: str) -> Scheme | None:
    """The scheme of `layer` in an AWQ config (None: left unquantized); AutoAWQ's GEMM packing."""
    if _skipped(raw, layer):
        return None
    bits = raw.get("bits", raw.get("w_bit"))
    size = raw.get("group_size", raw.get("q_group_size"))
    version, zero_point = str(raw.get("version", "gemm")).lower(), raw.get("zero_point", True)
    desc = f"awq (bits {bits}, group_size {size}, version {version}, zero_point {zero_point})"

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"{where}: layer {layer} uses {desc}, which tinypaged does not run: {why}")

    if bits != 4:
        raise refuse("AWQ is read with 4-bit codes")
    if version != "gemm":
        raise refuse("only the GEMM packing is read")
    if not zero_point:
        raise refuse("AWQ is read with zero points")
    return IntScheme(4, _group(size, refuse), True, "awq")


# ---- GGUF blocks kept quantized (weights/gguf_convert.py writes the config, weights/gguf_quant.py the tensors) --

# GGUF type -> (bits of a code, group, mins): how weights/gguf_quant.py repacks it
GGUF_TYPES = {
    "Q4_0": (4, 32, False),
    "Q4_1": (4, 32, True),
    "Q5_0": (8, 32, False),
    "Q5_1": (8, 32, True),
    "Q8_0": (8, 32, False),
    "Q4_K": (4, 32, True),
    "Q5_K": (8, 32, True),
    "Q6_K": (8, 16, False),
}


def _gguf(raw: dict[str, Any], layer: str, where: str) -> Scheme | None:
    """The scheme of `layer` kept in its GGUF blocks (None: the GGUF stores it in float)."""
    kind = (raw.get("layers") or {}).get(layer)
    if kind is None:
        return None
    parts = kind.split("+") if isinstance(kind, str) else [kind]
    if any(part not in GGUF_TYPES for part in parts):
        raise ConfigError(
            f"{where}: layer {layer} is GGUF type {kind!r}, which tinypaged does not run kept quantized "
            f"(it runs {', '.join(GGUF_TYPES)})"
        )
    if len(parts) > 1:  # fused parts of different types in one layout: 8-bit codes, zero points and mins
        return IntScheme(8, min(GGUF_TYPES[part][1] for part in parts), True, "gguf", True)
    bits, group, mins = GGUF_TYPES[kind]
    return IntScheme(bits, group, False, "gguf", mins)


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
