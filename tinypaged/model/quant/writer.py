"""`tinypaged quantize`: a bf16 or f32 model directory written as a compressed-tensors FP8_DYNAMIC checkpoint.

The format is the one llm-compressor writes and vLLM loads: each decoder linear layer's `weight` in E4M3 with a
`weight_scale` `[out, 1]` (one float32 scale per output channel), activations quantized dynamically per token
at run time (nothing stored for them), the embedding, the norms and the LM head as they were (`lm_head` in the
`ignore` list), and config.json's `quantization_config` saying so. The quantization is `fp8.quantize_per_channel`,
the same as `--quantization fp8` at load. Every other file (tokenizer, generation config) is copied. The output
directory is written beside its final name and renamed into place: an interrupted run leaves nothing.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tinypaged.errors import ConfigError
from tinypaged.model.loader import checkpoint_files
from tinypaged.model.quant.fp8 import quantize_per_channel

# The decoder's linear layers (what `Linear` targets there); the LM head is left out, as llm-compressor does.
_QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def _args(strategy: str, dynamic: bool) -> dict[str, Any]:
    """One side's QuantizationArgs as compressed-tensors serialises them."""
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "strategy": strategy,
        "block_structure": None,
        "dynamic": dynamic,
        "actorder": None,
        "observer": None if dynamic else "minmax",
        "observer_kwargs": {},
    }


FP8_DYNAMIC_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "global_compression_ratio": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": _args("channel", dynamic=False),
            "input_activations": _args("token", dynamic=True),
            "output_activations": None,
            "format": "float-quantized",
        }
    },
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "sparsity_config": {},
    "transform_config": {},
}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def quantize_checkpoint(src: Path, out: Path) -> Path:
    """Write `src` (a full-precision model directory) to `out` as an FP8_DYNAMIC compressed-tensors
    checkpoint; returns `out`. ConfigError if `src` is not a model directory this engine runs or is already
    quantized, or if `out` exists or cannot be created."""
    from tinypaged.config import ModelConfig

    src, out = Path(src), Path(out)
    ModelConfig.from_dir(src)  # a model directory this engine runs, or ConfigError saying why not
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method")
        raise ConfigError(f"{src} is already quantized ({method}); quantize a bf16 or f32 checkpoint")
    if out.exists():
        raise ConfigError(f"{out} exists; give a new directory")
    files = checkpoint_files(src)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise ConfigError(f"cannot write {out}: {e.strerror or e}") from e
    try:
        weight_map: dict[str, str] = {}
        for file in files:
            tensors: dict[str, torch.Tensor] = {}
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    t = f.get_tensor(name)
                    if _QUANTIZED.match(name):
                        if not t.is_floating_point() or t.element_size() == 1:
                            raise ConfigError(f"{name} in {file} is {t.dtype}, not a full-precision weight")
                        q, scale = quantize_per_channel(t)
                        tensors[name], tensors[name + "_scale"] = q, scale[:, None].contiguous()
                    else:
                        tensors[name] = t
            save_file(tensors, str(tmp / file.name), metadata={"format": "pt"})
            os.chmod(tmp / file.name, 0o644)  # safetensors creates files 0600
            weight_map.update(dict.fromkeys(tensors, file.name))
            del tensors
        if len(files) > 1:
            total = sum((tmp / f.name).stat().st_size for f in files)
            _write_json(
                tmp / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map},
            )
        for extra in src.iterdir():  # the tokenizer, generation_config.json, a chat template...
            skip = extra.name.startswith(".") or extra.suffix == ".safetensors" or not extra.is_file()
            if not skip and extra.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copyfile(extra, tmp / extra.name)
        _write_json(tmp / "config.json", {**config, "quantization_config": FP8_DYNAMIC_CONFIG})
        os.replace(tmp, out)  # refused above if `out` existed
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
