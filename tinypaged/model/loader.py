"""Load a Hugging Face-style safetensors checkpoint (single file or sharded) straight into the model."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tinypaged.config import ConfigError, ModelConfig
from tinypaged.model.llama import LlamaForCausalLM

# checkpoint name suffix -> (our parameter suffix, index of the shard inside a fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


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


def _tensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint, read one at a time, onto `device` directly when it can."""
    load_device = "cpu" if device.type == "cpu" else str(device)
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device=load_device) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for bad headers and short files
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"cannot read checkpoint {file}: {type(e).__name__}: {e}") from e


def load_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int
) -> LlamaForCausalLM:
    """Build the model on the meta device, then materialise each parameter once on `device` in `dtype`
    and copy the checkpoint tensors into it: no second copy of the weights is ever held."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    params = dict(model.named_parameters())
    for name, p in params.items():
        owner, attr = _owner(model, name)
        setattr(
            owner,
            attr,
            torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device), requires_grad=False),
        )
    params = dict(model.named_parameters())
    model.cos_sin_cache = torch.empty(0, device=device)

    loaded: set[str] = set()
    for name, tensor in _tensors(checkpoint_files(cfg.path), device):
        target, rows = _target(name, cfg)
        if target is None:
            continue  # e.g. rotary inv_freq buffers some checkpoints carry
        if cfg.tie_word_embeddings and target == "lm_head.weight":
            continue
        if target not in params:
            raise ConfigError(f"unexpected tensor {name!r} in checkpoint {cfg.path}")
        dst = params[target].data
        if rows is not None:
            dst = dst[rows[0] : rows[1]]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ConfigError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)} from config.json"
            )
        dst.copy_(tensor)
        loaded.add(f"{target}:{rows}")

    expected = {f"{t}:{r}" for t, r in (_target(n, cfg) for n in _checkpoint_names(cfg))}
    missing = sorted(expected - loaded)
    if missing:
        raise ConfigError(
            f"checkpoint {cfg.path} lacks {len(missing)} tensor(s), e.g. {missing[0].split(':')[0]}"
        )
    model.init_rope()
    return model.eval()


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The module holding parameter `name` and the attribute name there."""
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def _target(name: str, cfg: ModelConfig) -> tuple[str | None, tuple[int, int] | None]:
    """Our parameter for a checkpoint tensor name, and the row range it fills inside a fused parameter."""
    if name.endswith("rotary_emb.inv_freq"):
        return None, None
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return "lm_head.weight", None
    m = _LAYER.match(name)
    if not m:
        return name, None  # reported as unexpected by the caller
    layer, module, kind = m.groups()
    prefix = f"layers.{layer}."
    if module not in _FUSED:
        return f"{prefix}{module}.{kind}", None
    fused, shard = _FUSED[module]
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    bounds = {
        "self_attn.qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
        "mlp.gate_up_proj": [(0, inter), (inter, 2 * inter)],
    }[fused]
    return f"{prefix}{fused}.{kind}", bounds[shard]


def _checkpoint_names(cfg: ModelConfig) -> list[str]:
    """The checkpoint names a complete checkpoint for this config has."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    if cfg.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkvo"]
    return [f"model.layers.{i}.{n}" for i in range(cfg.num_layers) for n in per_layer] + names
