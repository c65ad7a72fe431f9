"""Load a Hugging Face-style safetensors checkpoint (single file or sharded) straight into the model, or into
this rank's share of it under tensor parallelism (each rank reads only its slices)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tinypaged.config import ConfigError, ModelConfig
from tinypaged.model.llama import LlamaForCausalLM
from tinypaged.model.parallel import TPGroup
from tinypaged.model.quant import Linear
from tinypaged.quantization import LAYER_LINEARS, resolve_quantization

# checkpoint name suffix -> (our parameter suffix, index of the shard inside a fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(\w+)$")
# A quantized checkpoint's KV-cache scales, read by `kv_cache_scales` (for an FP8 KV cache), not as parameters:
# compressed-tensors' and vLLM's `self_attn.k_scale` / `v_scale`, ModelOpt's `self_attn.k_proj.k_scale` /
# `v_proj.v_scale`, and the older single `self_attn.kv_scale` of both.
_KV_SCALES = (".k_scale", ".v_scale", ".kv_scale")
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:([kv])_proj\.)?([kv]v?)_scale$")


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory: the shards its index names, or its single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ConfigError(f"bad safetensors index {index}: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in {path} (only safetensors checkpoints are loaded)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"missing checkpoint shard(s) in {path}: {', '.join(missing)}")
    return files


@dataclass(frozen=True)
class _Piece:
    """Where (part of) a checkpoint tensor goes: the parameter, the rows it fills there (a part of a fused
    parameter, or the vocabulary rows a rank holds) and the part of the checkpoint tensor that this rank reads."""

    target: str
    rows: tuple[int, int] | None  # rows of the parameter (None: all of it)
    # The part of the checkpoint tensor read (all of it when no rank split it); for a linear layer's tensors,
    # the weight's rows then columns, which its method's layout maps onto the tensor (a scale's, a block's).
    src: tuple[slice, ...]

    @property
    def key(self) -> str:
        return f"{self.target}:{self.rows}"


def load_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: TPGroup | None = None,
    quantization: str | None = None,
    cpu_kernels: bool = False,
) -> LlamaForCausalLM:
    """Build the model (this rank's share of it, under tensor parallelism) on the meta device, then
    materialise each parameter once on `device` in `dtype` and copy the checkpoint's slices into it: a rank
    reads only its own slices from the safetensors files, and no second copy of the weights is ever held.
    The linear layers run as the checkpoint's quantization_config says, or quantized at load as `quantization`
    asks (tinypaged/quantization.py); a scheme that cannot run is refused before anything is materialised.
    Their methods keep the dtypes of their formats (FP8 values, float32 scales). With `cpu_kernels` (the
    engine's choice; tests that read the layout leave it off), weight-only layers on the CPU are repacked for
    torch's kernels, and a GGUF model's tied embedding is held in its int8 codes (model/quant/cpu.py)."""
    tp = tp or TPGroup()
    quant = resolve_quantization(
        cfg.quantization_config, quantization, str(cfg.path), cfg.num_layers, not cfg.tie_word_embeddings
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, tp, quant)
        # The unsplit model: the shapes of the checkpoint's tensors.
        whole = LlamaForCausalLM(cfg, max_positions, quant=quant) if tp.size > 1 else model
    full = {name: tuple(p.shape) for name, p in whole.named_parameters()}
    whole_linears = {name: m for name, m in whole.named_modules() if isinstance(m, Linear)}
    params = dict(model.named_parameters())
    for name, p in params.items():
        owner, attr = _owner(model, name)
        # Zeroed: the vocabulary padding rows of the last rank must hold zeros (their logits are cut off).
        p_dtype = p.dtype if getattr(p, "keep_dtype", False) else dtype
        try:
            zeros = torch.zeros(p.shape, dtype=p_dtype, device=device)
        except (RuntimeError, MemoryError) as e:  # torch's allocators raise RuntimeError (OutOfMemoryError)
            size = math.prod(p.shape) * p_dtype.itemsize
            raise ConfigError(
                f"{cfg.path}: {name} {tuple(p.shape)} ({size / 2**30:.1f} GiB) cannot be allocated on {device}: "
                f"the model config.json describes does not fit ({type(e).__name__})"
            ) from e
        setattr(owner, attr, torch.nn.Parameter(zeros, requires_grad=False))
    params = dict(model.named_parameters())
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    model.cos_sin_cache = torch.empty(0, device=device)

    loaded: set[str] = set()
    for name, piece, shape, tensor in _slices(checkpoint_files(cfg.path), cfg, tp):
        whole_piece = _piece(name, cfg, TPGroup())
        assert whole_piece is not None
        module, _, suffix = piece.target.rpartition(".")
        if module in linears and suffix != "bias":
            _load_linear(name, linears[module], whole_linears[module], piece, whole_piece.rows, shape, tensor)
            loaded.add(piece.key)
            continue
        if piece.target not in params:
            raise ConfigError(f"unexpected tensor {name!r} in checkpoint {cfg.path}")
        want = _rows_shape(full[piece.target], whole_piece.rows)
        if shape != want:
            raise ConfigError(f"tensor {name!r} has shape {shape}, expected {want} from config.json")
        dst = params[piece.target].data
        if piece.rows is not None:
            dst = dst[piece.rows[0] : piece.rows[1]]
        src = tensor[piece.src]
        if not src.is_floating_point():  # integers would be cast to values they never held
            raise ConfigError(f"tensor {name!r} is {src.dtype}, expected floating-point values")
        dst[: src.shape[0]].copy_(src)  # fewer rows than dst only where the vocabulary is padded
        loaded.add(piece.key)

    expected = {p.key for p in (_piece(n, cfg, tp) for n in _checkpoint_names(cfg, linears)) if p is not None}
    missing = sorted(expected - loaded)
    if missing:
        raise ConfigError(
            f"checkpoint {cfg.path} lacks {len(missing)} tensor(s), e.g. {missing[0].split(':')[0]}"
        )
    for layer in linears.values():
        layer.method.finish(layer)
        if cpu_kernels:
            layer.method.pack_for_cpu(layer)
    model.fold_norm_offsets()
    model.init_rope()
    gguf = (cfg.quantization_config or {}).get("quant_method") == "gguf"
    if cpu_kernels and gguf and cfg.tie_word_embeddings:
        model.embed_tokens.keep_int8()  # the file's Q8_0 codes found back, on the CPU
    return model.eval()


def _load_linear(
    name: str,
    layer: Linear,
    whole: Linear,
    piece: _Piece,
    whole_rows: tuple[int, int] | None,
    shape: tuple[int, ...],
    tensor: Any,
) -> None:
    """One checkpoint tensor of a linear layer into this rank's share of it, as the layer's method lays it out
    (`whole` is the unsplit layer, `whole_rows` the rows of it the tensor covers)."""
    suffix = piece.target.rpartition(".")[2]
    layout = layer.method.tensors().get(suffix)
    if layout is None:
        raise ConfigError(f"unexpected tensor {name!r} for layer {layer.name}, which runs {layer.method}")
    rows = whole.out_features if whole_rows is None else whole_rows[1] - whole_rows[0]
    if not layout.fits(shape, rows, whole.in_features):
        want = layout.shape(rows, whole.in_features)
        raise ConfigError(
            f"tensor {name!r} has shape {shape}, expected {want} ({layer.method}) from config.json"
        )
    src_rows, src_cols = (*piece.src, slice(None))[:2]
    src = tensor[layout.index(src_rows, src_cols, name)]
    if ("scale" in suffix or suffix == "mins") and not src.is_floating_point():  # would load truncated
        raise ConfigError(f"tensor {name!r} is {src.dtype}, but scales are floating-point ({layer.method})")
    if suffix == "weight" and not src.is_floating_point():  # integer codes come as qweight / weight_packed
        raise ConfigError(
            f"tensor {name!r} is {src.dtype}, but no quantization_config covers it ({layer.method})"
        )
    layer.method.load(layer, suffix, src, piece.rows)


def _slices(
    files: list[Path], cfg: ModelConfig, tp: TPGroup
) -> Iterator[tuple[str, _Piece, tuple[int, ...], Any]]:
    """(name, where it goes, its shape in the checkpoint, a lazy safetensors slice of it) of every tensor this
    rank loads, one at a time: indexing the slice reads only those bytes of the file."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    piece = _piece(name, cfg, tp)
                    if piece is not None:
                        tensor = f.get_slice(name)
                        yield name, piece, tuple(tensor.get_shape()), tensor
        except Exception as e:  # safetensors raises its own error types for bad headers and short files
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"cannot read checkpoint {file}: {type(e).__name__}: {e}") from e


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The module holding parameter `name` and the attribute name there."""
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def _rows_shape(shape: tuple[int, ...], rows: tuple[int, int] | None) -> tuple[int, ...]:
    return shape if rows is None else (rows[1] - rows[0], *shape[1:])


_ALL = (slice(None),)


def _piece(name: str, cfg: ModelConfig, tp: TPGroup) -> _Piece | None:
    """Where this rank puts a checkpoint tensor (None: nowhere, e.g. rotary buffers some checkpoints carry,
    a tied LM head, or a row-parallel bias outside rank 0)."""
    if name.endswith("rotary_emb.inv_freq") or name.endswith(_KV_SCALES):
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return None
        start, end, _ = tp.vocab(cfg.vocab_size)
        target = "embed_tokens.weight" if name.startswith("model.") else "lm_head.weight"
        return _Piece(target, (0, end - start) if tp.size > 1 else None, (slice(start, end),))
    if name == "model.norm.weight":
        return _Piece("norm.weight", None, _ALL)
    m = _LAYER.match(name)
    if not m:
        return _Piece(name, None, _ALL)  # reported as unexpected by the caller
    layer, module, kind = m.groups()
    prefix = f"layers.{layer}."
    d, inter = cfg.head_dim, cfg.intermediate_size
    q0, q1 = (h * d for h in tp.split(cfg.num_heads))
    kv0, kv1 = (h * d for h in tp.kv_heads(cfg.num_kv_heads))
    i0, i1 = tp.split(inter)
    if module in ("self_attn.o_proj", "mlp.down_proj"):  # row-parallel: this rank's input columns
        if kind == "bias":
            return _Piece(f"{prefix}{module}.bias", None, _ALL) if tp.rank == 0 else None
        lo, hi = (q0, q1) if module == "self_attn.o_proj" else (i0, i1)
        return _Piece(f"{prefix}{module}.{kind}", None, (slice(None), slice(lo, hi)))
    if module not in _FUSED:
        return _Piece(f"{prefix}{module}.{kind}", None, _ALL)
    fused, part = _FUSED[module]
    q, kv, il = q1 - q0, kv1 - kv0, i1 - i0
    # This rank's rows of each part, and where they go in the fused parameter.
    src = {
        "self_attn.qkv_proj": [(q0, q1), (kv0, kv1), (kv0, kv1)],
        "mlp.gate_up_proj": [(i0, i1), (i0, i1)],
    }[fused][part]
    dst = {
        "self_attn.qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
        "mlp.gate_up_proj": [(0, il), (il, 2 * il)],
    }[fused][part]
    return _Piece(f"{prefix}{fused}.{kind}", dst, (slice(*src),))


def _checkpoint_names(cfg: ModelConfig, linears: dict[str, Linear]) -> list[str]:
    """The checkpoint names a complete checkpoint for this config has (a linear layer's: the tensors its method
    reads, e.g. `weight` and `weight_scale`)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if cfg.family == "gemma3":
        per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    if cfg.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if cfg.qkv_bias or cfg.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if cfg.attention_bias:
        per_layer.append("self_attn.o_proj.bias")
    for i in range(cfg.num_layers):
        names += [f"model.layers.{i}.{n}" for n in per_layer]
        for module in LAYER_LINEARS:
            layer = linears[f"layers.{i}.{_FUSED.get(module, (module, 0))[0]}"]
            names += [f"model.layers.{i}.{module}.{suffix}" for suffix in layer.method.tensors()]
    return names


def kv_cache_scales(cfg: ModelConfig) -> list[tuple[float, float]] | None:
    """The checkpoint's FP8 KV-cache scales, (k_scale, v_scale) of each layer; None when it has none. One scale
    a layer for keys and one for values (per-tensor, as compressed-tensors' `kv_cache_scheme` with strategy
    `tensor` writes them); a scale per head, a layer without scales, or a scale that is not a positive finite
    number is a ConfigError."""
    found: dict[tuple[int, str], float] = {}
    for file in checkpoint_files(cfg.path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                m = _KV_SCALE.match(name)
                if not m or (m.group(2) and m.group(2) != m.group(3)):
                    continue
                value = f.get_tensor(name).float()
                if value.numel() != 1 or not (math.isfinite(value.item()) and value.item() > 0):
                    raise ConfigError(
                        f"KV-cache scale {name!r} in {cfg.path} must be one positive number (a scale per layer; "
                        f"per-head scales are not run), got shape {tuple(value.shape)}"
                    )
                for kind in ("k", "v") if m.group(3) == "kv" else (m.group(3),):
                    found[(int(m.group(1)), kind)] = value.item()
    if not found:
        return None
    missing = [f"{k}_scale of layer {i}" for i in range(cfg.num_layers) for k in "kv" if (i, k) not in found]
    if missing:
        raise ConfigError(
            f"checkpoint {cfg.path} has KV-cache scales but lacks {len(missing)}, e.g. {missing[0]}"
        )
    return [(found[(i, "k")], found[(i, "v")]) for i in range(cfg.num_layers)]
