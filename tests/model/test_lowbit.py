"""Weight-only INT4 / INT8 checkpoints against independent code: what compressed-tensors writes (W4A16, W8A16,
with and without zero points), GPTQ and AWQ tensors in their published packings (packed here by code written
from AutoGPTQ's and AutoAWQ's `pack`, apart from the loader; AWQ read back through compressed-tensors' own
AutoAWQ converter), each repacked at load into the kernels' layout and unpacked to exactly the reference's
dequantized weights; tensor-parallel shares; round-to-nearest at load; schemes refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tinypaged.config import ConfigError, EngineConfig, ModelConfig
from tinypaged.model import load_model
from tinypaged.model.parallel import TPGroup
from tinypaged.model.quant import lowbit

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from compressed_tensors import ModelCompressor  # noqa: E402
from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

VOCAB, GROUP = 211, 32
PARTS = {
    "self_attn.qkv_proj": ("q", "k", "v"),
    "self_attn.o_proj": ("o",),
    "mlp.gate_up_proj": ("gate", "up"),
}
PARTS["mlp.down_proj"] = ("down",)


def _module(fused: str, part: str) -> str:
    return f"{fused.split('.')[0]}.{part}_proj"


def _hf_model(seed: int = 0, vocab: int = VOCAB) -> transformers.LlamaForCausalLM:
    """Two layers; every input width (64, 128) and each tensor-parallel half of it a multiple of GROUP."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model


def _ours(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each linear layer's weight as tinypaged unpacks it (float32), by our module name."""
    return {
        n: lowbit.dequantize_weight(m.method.weight(m))
        for n, m in model.named_modules()
        if hasattr(m, "qweight")
    }


def _fused(weights: dict[str, torch.Tensor], prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Per-module reference weights (checkpoint names) concatenated as tinypaged fuses them."""
    return {
        f"layers.{i}.{fused}": torch.cat([weights[f"{prefix}layers.{i}.{_module(fused, p)}"] for p in parts])
        for i in range(2)
        for fused, parts in PARTS.items()
    }


def _assert_same(
    ours: dict[str, torch.Tensor], want: dict[str, torch.Tensor], dtype: torch.dtype | None = None
) -> None:
    """Bit for bit; `dtype`: the reference dequantizes in that dtype (ours, the exact float32 product, rounded
    to it once, must give its values)."""
    assert set(ours) == set(want)
    for name, w in want.items():
        got = ours[name] if dtype is None else ours[name].to(dtype).float()
        assert torch.equal(got, w.float()), name


# ---- compressed-tensors pack-quantized -------------------------------------------------------------------------


def _write_compressed_tensors(tmp: Path, bits: int, symmetric: bool, strategy: str) -> Path:
    """A W4A16 / W8A16 checkpoint as llm-compressor saves one: compressed-tensors' config, qparams, compressor."""
    model = _hf_model()
    group = GROUP if strategy == "group" else None
    args = QuantizationArgs(
        num_bits=bits, type="int", strategy=strategy, group_size=group, symmetric=symmetric
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(model, QuantizationConfig(config_groups={"g": scheme}, ignore=["lm_head"]))
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is not None:
            w = m.weight.data.unflatten(1, (-1, GROUP)) if group else m.weight.data[:, None, :]
            scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
            m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data.copy_(zero.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    out = tmp / f"ct-w{bits}-{strategy}-{'sym' if symmetric else 'asym'}"
    model.save_pretrained(out)
    compressor.update_config(str(out))
    return out


def _decompressed(path: Path) -> transformers.LlamaForCausalLM:
    decompress = transformers.CompressedTensorsConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=decompress
    )


@pytest.mark.parametrize(
    "bits, symmetric, strategy",
    [(4, True, "group"), (4, False, "group"), (8, True, "channel"), (8, False, "group")],
)
def test_compressed_tensors_weights_unpack_to_its_own_dequantization(
    tmp_path: Path, bits: int, symmetric: bool, strategy: str, agrees_with_hf
) -> None:
    path = _write_compressed_tensors(tmp_path, bits, symmetric, strategy)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"
    ours = load_model(ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), 64)
    layer = ours.layers[0].self_attn.qkv_proj
    assert layer.qweight.dtype == torch.int32 and (layer.zeros is None) == symmetric
    hf = _decompressed(path)
    _assert_same(_ours(ours), _fused({n: m.weight for n, m in hf.named_modules() if n.endswith("_proj")}))
    agrees_with_hf(ours, hf, VOCAB, 1e-4)


# ---- GPTQ and AWQ in their published packings -----------------------------------------------------------------


def _rtn(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max codes `[N, K]`, zero points and scales `[K / GROUP, N]` (GPTQ's and AWQ's grid)."""
    g = w.unflatten(1, (-1, GROUP))
    top = 2**bits - 1
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / top).half().float()
    zero = (-lo / scale).round().clamp(0, top)
    q = ((g / scale[..., None]).round() + zero[..., None]).clamp(0, top)
    return q.flatten(1).int(), zero.t().int().contiguous(), scale.t().contiguous()


def _pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's qweight packing: word i of a column holds rows [i * 32 / bits, ...), the first in the low bits."""
    per = 32 // bits
    out = torch.zeros(v.shape[0] // per, v.shape[1], dtype=torch.int64)
    for j in range(per):
        out |= v[j::per].long() << (bits * j)
    return out.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else out.int()


def _pack_cols(v: torch.Tensor, bits: int, order: list[int]) -> torch.Tensor:
    """Columns packed into words: bits [bits * j, ...) of word c hold column c * per + order[j]."""
    per = 32 // bits
    out = torch.zeros(v.shape[0], v.shape[1] // per, dtype=torch.int64)
    for j in range(per):
        out |= v[:, order[j] :: per].long() << (bits * j)
    return torch.where(out >= 2**31, out - 2**32, out).int()


def _write_packed(tmp: Path, method: str, bits: int = 4, g_idx: str = "in-order") -> tuple[Path, dict]:
    """The tiny model with each decoder linear layer as a GPTQ (v1: zero points stored less one) or AWQ (GEMM)
    module; returns the path and the reference's dequantized weights by module name."""
    model = _hf_model()
    out = tmp / method
    model.save_pretrained(out)
    tensors, want = {}, {}
    for name, m in model.named_modules():
        if not name.endswith("_proj"):
            continue
        q, zero, scale = _rtn(m.weight.data, bits)
        k = q.shape[1]
        if method == "gptq":
            idx = torch.arange(k, dtype=torch.int32) // GROUP
            if g_idx == "shuffled":
                idx = idx[torch.randperm(k, generator=torch.Generator().manual_seed(0))]
            tensors[f"{name}.qweight"] = _pack_rows(q.t(), bits)
            tensors[f"{name}.qzeros"] = _pack_cols(zero - 1, bits, list(range(32 // bits)))
            tensors[f"{name}.scales"] = scale.half()
            tensors[f"{name}.g_idx"] = idx
            # The published dequantization (AutoGPTQ / exllama): zeros + 1, scales and zeros read by g_idx.
            zeros = ((tensors[f"{name}.qzeros"][:, :, None] >> torch.arange(0, 32, bits)) & (2**bits - 1)) + 1
            zeros = zeros.flatten(1)
            want[name] = (scale.half().float()[idx.long()] * (q.t() - zeros[idx.long()]).float()).t()
        else:
            order = [0, 2, 4, 6, 1, 3, 5, 7]
            tensors[f"{name}.qweight"] = _pack_cols(q.t(), 4, order)
            tensors[f"{name}.qzeros"] = _pack_cols(zero, 4, order)
            tensors[f"{name}.scales"] = scale.half()
    others = {n: p.data for n, p in model.named_parameters() if "_proj" not in n}
    if method == "awq":  # the reference: compressed-tensors' AutoAWQ converter, then its decompression
        converted = AutoAWQConverter(group_size=GROUP).process(dict(tensors))
        ct = out.parent / "awq-as-ct"
        model.save_pretrained(ct)
        save_file(others | converted, str(ct / "model.safetensors"))
        config = json.loads((ct / "config.json").read_text())
        config["quantization_config"] = AutoAWQConverter(group_size=GROUP)._build_quant_config().model_dump()
        (ct / "config.json").write_text(json.dumps(config))
        hf = _decompressed(ct)
        want = {n: m.weight.data for n, m in hf.named_modules() if n.endswith("_proj")}
    save_file(others | tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": False, "sym": False}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config))
    return out, want


@pytest.mark.parametrize("method, bits", [("gptq", 4), ("gptq", 8), ("awq", 4)])
def test_gptq_and_awq_unpack_to_the_reference_dequantization(
    tmp_path: Path, method: str, bits: int, agrees_with_hf
) -> None:
    path, want = _write_packed(tmp_path, method, bits)
    ours = load_model(ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), 64)
    # compressed-tensors dequantizes AWQ's float16 scales in float16, as AutoAWQ does: (code - zero) * scale,
    # exact in float32 (an 11-bit scale times a 4-bit integer), rounded once.
    _assert_same(_ours(ours), _fused(want), torch.float16 if method == "awq" else None)
    hf = _hf_model()
    with torch.no_grad():
        for n, m in hf.named_modules():
            if n.endswith("_proj"):
                m.weight.copy_(want[n])
    # AWQ's reference weights are float16 roundings of the exact products tinypaged runs.
    agrees_with_hf(ours, hf, VOCAB, 1e-4 if method == "gptq" else 2e-3)


def test_gptq_act_order_is_refused_naming_the_layer(tmp_path: Path) -> None:
    path, _ = _write_packed(tmp_path, "gptq", g_idx="shuffled")
    with pytest.raises(ConfigError, match=r"model\.layers\.\d+\.\w+\.\w+_proj\.g_idx: .*desc_act") as err:
        load_model(ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), 64)
    assert "\n" not in str(err.value)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"layer model\.layers\.0\.self_attn\.q_proj uses gptq.*desc_act"):
        EngineConfig(model=path)


@pytest.mark.parametrize(
    ("method", "tensor", "damage", "match"),
    [
        ("gptq", "scales", "nan", r"self_attn\.o_proj\.scales: 1 of \d+ values are not finite"),
        ("awq", "scales", "inf", r"self_attn\.o_proj\.scales: 1 of \d+ values are not finite"),
        ("gptq", "g_idx", "float", r"self_attn\.o_proj\.g_idx is torch\.float32, expected integer"),
    ],
)
def test_a_damaged_gptq_or_awq_tensor_is_refused_naming_it(
    tmp_path: Path, method: str, tensor: str, damage: str, match: str
) -> None:
    """A scale that is not finite (it would make every logit NaN) or a g_idx of floats (truncated, it passed the
    act-order check) fails the load in one line naming the tensor."""
    from safetensors.torch import load_file

    path, _ = _write_packed(tmp_path, method)
    tensors = load_file(str(path / "model.safetensors"))
    name = f"model.layers.1.self_attn.o_proj.{tensor}"
    if damage == "float":
        tensors[name] = tensors[name].float()
    else:
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[3] = float(damage)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match=match) as err:
        load_model(ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), 64)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("method", ["ct", "gptq"])
def test_tensor_parallel_shares_take_their_groups(tmp_path: Path, method: str) -> None:
    """Each rank's unpacked share is its rows (q, k, v, gate, up) or columns (o, down) of the whole layer's,
    scales and zero points included (zero points packed along the rows: shares start on a word)."""
    path = (
        _write_compressed_tensors(tmp_path, 4, False, "group")
        if method == "ct"
        else _write_packed(tmp_path, "gptq")[0]
    )
    cfg = ModelConfig.from_dir(path)
    whole = _ours(load_model(cfg, torch.float32, torch.device("cpu"), 64))
    shares = [_ours(load_model(cfg, torch.float32, torch.device("cpu"), 64, TPGroup(r, 2))) for r in range(2)]
    q, kv, inner, hidden = 64, 32, 128, 64
    for layer in ("layers.0", "layers.1"):
        full = whole[f"{layer}.self_attn.qkv_proj"]
        for r, share in enumerate(shares):
            rows = [(r * q // 2, (r + 1) * q // 2), (q + r * kv // 2, q + (r + 1) * kv // 2)]
            rows.append((q + kv + r * kv // 2, q + kv + (r + 1) * kv // 2))
            assert torch.equal(share[f"{layer}.self_attn.qkv_proj"], torch.cat([full[a:b] for a, b in rows]))
            gate_up = whole[f"{layer}.mlp.gate_up_proj"]
            half = [
                (r * inner // 2, (r + 1) * inner // 2),
                (inner + r * inner // 2, inner + (r + 1) * inner // 2),
            ]
            assert torch.equal(share[f"{layer}.mlp.gate_up_proj"], torch.cat([gate_up[a:b] for a, b in half]))
            cols = slice(r * inner // 2, (r + 1) * inner // 2)
            assert torch.equal(share[f"{layer}.mlp.down_proj"], whole[f"{layer}.mlp.down_proj"][:, cols])
            cols = slice(r * hidden // 2, (r + 1) * hidden // 2)
            assert torch.equal(
                share[f"{layer}.self_attn.o_proj"], whole[f"{layer}.self_attn.o_proj"][:, cols]
            )


# ---- round to nearest at load ------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantization, bits, zeros", [("int4", 4, True), ("int8", 8, False)])
def test_round_to_nearest_at_load(tmp_path: Path, quantization: str, bits: int, zeros: bool) -> None:
    """`quantization="int4"` / `"int8"` gives `quantize_rtn` of each checkpoint weight, within half a step."""
    model = _hf_model()
    model.save_pretrained(tmp_path)
    ours = load_model(
        ModelConfig.from_dir(tmp_path), torch.float32, torch.device("cpu"), 64, quantization=quantization
    )
    assert ours.lm_head.weight.dtype == torch.float32
    weights = _fused({n: m.weight.data for n, m in model.named_modules() if n.endswith("_proj")})
    for name, got in _ours(ours).items():
        group = 128 if "down" in name else 64  # 128, else the largest power of two that divides the input
        w = weights[name]
        assert torch.equal(got, lowbit.dequantize_weight(lowbit.quantize_rtn(w, bits, group, not zeros))), (
            name
        )
        g = w.unflatten(1, (-1, group))
        span = g.amax(-1).clamp(min=0) - g.amin(-1).clamp(max=0) if zeros else 2 * g.abs().amax(-1)
        step = (span / (2**bits - 1 if zeros else 2**bits - 2)).repeat_interleave(group, 1)
        assert ((got - w).abs() <= step / 2 * (1 + 1e-5)).all()


def test_layers_the_cpu_kernels_do_not_take_are_named(tmp_path: Path) -> None:
    """`cpu_reference_layers` (the engine's `RunnerStats.cpu_reference_layers`): none once packed for torch's
    kernels, every weight-only layer where the layout is left as loaded."""
    from tinypaged.model.quant import cpu_reference_layers

    _hf_model().save_pretrained(tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    # A fused layer is named by its first part (q_proj, gate_proj).
    named = [f"model.layers.{i}.{_module(f, p[0])}" for i in (0, 1) for f, p in PARTS.items()]
    for cpu_kernels, want in ((True, []), (False, named)):
        ours = load_model(
            cfg, torch.float32, torch.device("cpu"), 64, quantization="int8", cpu_kernels=cpu_kernels
        )
        assert cpu_reference_layers(ours) == want


def _ct(fmt: str, **weights: object) -> dict:
    group = {
        "targets": ["Linear"],
        "weights": {"type": "int", "strategy": "group", "group_size": 128} | weights,
    }
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"g": group}}


UNSUPPORTED = {
    "ct-int-quantized": (_ct("int-quantized", num_bits=8, strategy="channel"), "format 'int-quantized'"),
    "ct-int3": (_ct("pack-quantized", num_bits=3), "W3A16"),
    "ct-act-order": (_ct("pack-quantized", num_bits=4, actorder="group"), "actorder 'group'"),
    "gptq-3bit": ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits 3"),
    "gptq-group-48": ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group_size 48"),
    "awq-gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version gemv"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_integer_schemes_fail_in_one_line(tmp_path: Path, case: str) -> None:
    qc, scheme = UNSUPPORTED[case]
    config = _hf_model().config.to_dict() | {"quantization_config": qc}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        EngineConfig(model=tmp_path)
    assert scheme in str(err.value) and "model.layers.0.self_attn.q_proj" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_group_that_does_not_divide_a_layer_is_refused(tmp_path: Path) -> None:
    model = _hf_model()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 96, "desc_act": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError, match=r"model\.layers\.0\.self_attn\.q_proj: 64 input columns .* groups of 96"
    ):
        load_model(ModelConfig.from_dir(tmp_path), torch.float32, torch.device("cpu"), 64)


MALFORMED = {  # a field of the wrong JSON type, as a damaged or hand-edited config.json may hold
    "ct-ignore-number": _ct("pack-quantized", num_bits=4) | {"ignore": 5},
    "ct-kv-scheme-number": _ct("pack-quantized", num_bits=4) | {"kv_cache_scheme": 3},
    "ct-groups-list": {"quant_method": "compressed-tensors", "config_groups": [1, 2]},
    "gptq-not-convert-number": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "modules_to_not_convert": 5,
    },
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_quantization_config_fails_in_one_line(tmp_path: Path, case: str) -> None:
    config = _hf_model().config.to_dict() | {"quantization_config": MALFORMED[case]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError, match=r"layer model\.layers\.0\.self_attn\.q_proj: .* is malformed"
    ) as err:
        EngineConfig(model=tmp_path)
    assert "\n" not in str(err.value)


def test_a_scale_stored_across_instead_of_along_the_rows_is_refused(tmp_path: Path) -> None:
    """A per-channel scale is `[out, 1]` (or `[out]`); `[1, out]` has the same values in another layout."""
    from safetensors.torch import load_file

    path = _write_compressed_tensors(tmp_path, 8, True, "channel")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    tensors[name] = tensors[name].t().contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match=rf"tensor '{name}' has shape \(1, \d+\), expected \(\d+,\)"):
        load_model(ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), 64)


@pytest.mark.parametrize("method", ["gptq", "ct"])
def test_integer_scales_are_refused(tmp_path: Path, method: str) -> None:
    """Scales stored as integers (truncated, mostly to zero) name the tensor instead of loading."""
    from safetensors.torch import load_file

    path = (
        _write_packed(tmp_path, "gptq")[0]
        if method == "gptq"
        else _write_compressed_tensors(tmp_path, 4, False, "group")
    )
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj." + ("scales" if method == "gptq" else "weight_scale")
    tensors[name] = tensors[name].to(torch.int64)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match=rf"tensor '{name}' is torch.int64, but scales are floating-point"):
        load_model(ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), 64)


@pytest.mark.parametrize("name", ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"])
def test_integer_values_in_a_full_precision_checkpoint_are_refused(tmp_path: Path, name: str) -> None:
    """A weight (or a norm's) stored as integers, with no quantization_config: cast, it would hold other values."""
    from safetensors.torch import load_file

    model = _hf_model()
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=rf"tensor '{name}' is torch\.int32"):
        load_model(ModelConfig.from_dir(tmp_path), torch.float32, torch.device("cpu"), 64)
