"""FP8 checkpoints against independent code (test-only: compressed-tensors and HF transformers): what
compressed-tensors writes loads here and matches its dequantized reference, what `tinypaged quantize` writes
compressed-tensors reads back to the same weights, and schemes the engine does not run fail in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tinypaged.cli import main
from tinypaged.config import ConfigError, EngineConfig, ModelConfig
from tinypaged.model import load_model
from tinypaged.model.parallel import TPGroup
from tinypaged.model.quant.fp8 import dequantize_weight

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")
from compressed_tensors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

VOCAB = 211
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
BLOCK = 32  # divides every part of the tiny model (q 64, k/v 32, MLP 96, hidden 64)


def _hf_model(seed: int = 0, vocab: int = VOCAB) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif "proj" in n:
                # One row far larger than the rest: per-tensor and per-channel scales then differ.
                p[0] *= 8
    return model


def _scheme(name: str) -> QuantizationScheme:
    if name == "FP8_BLOCK":
        weights = QuantizationArgs(
            num_bits=8, type="float", strategy="block", block_structure=[BLOCK, BLOCK], symmetric=True
        )
        acts = QuantizationArgs(num_bits=8, type="float", strategy="group", group_size=BLOCK, dynamic=True)
        return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    if name == "FP8_WEIGHT_ONLY":
        weights = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
        return QuantizationScheme(targets=["Linear"], weights=weights)
    return preset_name_to_scheme(name, ["Linear"])


def _calibrate(model: torch.nn.Module, sample: torch.Tensor) -> None:
    """The observers' job, done with compressed-tensors' own qparams function: weight scales from each
    weight's min/max per its strategy, static input scales from one calibration pass's inputs."""
    seen: dict[str, float] = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda m, a, n=n: seen.__setitem__(n, max(seen.get(n, 0), a[0].abs().max()))
        )
        for n, m in model.named_modules()
        if hasattr(m, "quantization_scheme")
    ]
    with torch.no_grad():
        model(sample)
    for h in hooks:
        h.remove()
    for n, m in model.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None:
            continue
        w, args = m.weight.data, scheme.weights
        if args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif args.strategy == "block":
            blocks = w.unflatten(0, (-1, BLOCK)).unflatten(2, (-1, BLOCK))
            lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
        else:
            lo, hi = w.min(), w.max()
        m.weight_scale.data.copy_(calculate_qparams(lo, hi, args)[0].reshape(m.weight_scale.shape))
        if hasattr(m, "input_scale"):
            amax = torch.tensor(float(seen[n]))
            scale = calculate_qparams(-amax, amax, scheme.input_activations)[0]
            m.input_scale.data.copy_(scale.reshape(m.input_scale.shape))


def _write_with_compressed_tensors(tmp: Path, scheme: str) -> Path:
    """A checkpoint as llm-compressor saves one: compressed-tensors' config, compressor and save path."""
    model = _hf_model()
    config = QuantizationConfig(config_groups={"group_0": _scheme(scheme)}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    _calibrate(model, torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3)))
    compressor = ModelCompressor.from_pretrained_model(model, "float-quantized")
    compressor.compress_model(model)
    out = tmp / scheme.lower()
    model.save_pretrained(out)
    compressor.update_config(str(out))
    return out


def _fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def _reference(path: Path, scheme: str) -> transformers.LlamaForCausalLM:
    """HF's model over compressed-tensors' own decompression (dequantized f32 weights), each linear layer's
    input quantized as the scheme says (written here, apart from tinypaged's fp8.py)."""
    decompress = transformers.CompressedTensorsConfig(dequantize=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=decompress
    )
    assert hf.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    scales = {}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        scales = {
            k.removesuffix(".input_scale"): f.get_tensor(k).float() for k in f.keys() if "input_scale" in k
        }

    def quantize_input(module: torch.nn.Module, args: tuple, name: str) -> tuple:
        x = args[0]
        if scheme == "FP8_DYNAMIC":
            x = _fake_quant(x, x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448)
        elif scheme == "FP8":
            x = _fake_quant(x, scales[name])
        elif scheme == "FP8_BLOCK":
            g = x.unflatten(-1, (-1, BLOCK))
            x = _fake_quant(g, g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448).flatten(-2)
        return (x,)

    for n, m in hf.named_modules():
        if n.endswith(LINEARS):
            m.register_forward_pre_hook(lambda m, a, n=n: quantize_input(m, a, n))
    return hf


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8", "FP8_BLOCK", "FP8_WEIGHT_ONLY"])
def test_compressed_tensors_checkpoint_matches_its_dequantized_reference(
    tmp_path: Path, scheme: str, agrees_with_hf
) -> None:
    path = _write_with_compressed_tensors(tmp_path, scheme)
    ours = load_model(ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), 64)
    assert ours.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert ours.lm_head.weight.dtype == torch.float32  # ignored: dense
    agrees_with_hf(ours, _reference(path, scheme), VOCAB, 1e-4)


def test_block_fp8_as_qwen3_publishes_it(tmp_path: Path, agrees_with_hf) -> None:
    """`quant_method: fp8` with `weight_block_size` and `weight_scale_inv` (Qwen3 / DeepSeek): compressed-tensors'
    block-quantized tensors, renamed to that format, run as the same reference."""
    path = _write_with_compressed_tensors(tmp_path, "FP8_BLOCK")
    file = path / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        tensors = {k.replace("weight_scale", "weight_scale_inv"): f.get_tensor(k) for k in f.keys()}
    from safetensors.torch import save_file

    save_file(tensors, str(file))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": ["lm_head"],
    }
    (path / "config.json").write_text(json.dumps(config))
    ours = load_model(ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), 64)
    ref_path = _write_with_compressed_tensors(tmp_path / "ref", "FP8_BLOCK")
    agrees_with_hf(ours, _reference(ref_path, "FP8_BLOCK"), VOCAB, 1e-4)


def _dequantized(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in model.named_modules():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            out[name] = dequantize_weight(m.weight, m.weight_scale, m.method.scheme.block)
    return out


@pytest.mark.parametrize("scheme", ["FP8", "FP8_DYNAMIC"])
def test_tensor_parallel_shards_take_their_scales(tmp_path: Path, scheme: str) -> None:
    """Each rank's dequantized share is the whole layer's (per-tensor q, k, v scales stay per shard), and the
    static input scale is the largest of the fused parts'."""
    path = _write_with_compressed_tensors(tmp_path, scheme)
    cfg = ModelConfig.from_dir(path)
    whole = load_model(cfg, torch.float32, torch.device("cpu"), 64)
    parts = [load_model(cfg, torch.float32, torch.device("cpu"), 64, TPGroup(r, 2)) for r in range(2)]
    w, shares = _dequantized(whole), [_dequantized(p) for p in parts]
    q, kv, inner = 64, 32, 96
    for layer in ("layers.0", "layers.1"):
        full = w[f"{layer}.self_attn.qkv_proj"]
        for r, share in enumerate(shares):
            got = share[f"{layer}.self_attn.qkv_proj"]
            rows = [(r * q // 2, (r + 1) * q // 2), (q + r * kv // 2, q + (r + 1) * kv // 2)]
            rows.append((q + kv + r * kv // 2, q + kv + (r + 1) * kv // 2))
            assert torch.equal(got, torch.cat([full[a:b] for a, b in rows]))
            half = slice(r * inner // 2, (r + 1) * inner // 2)
            assert torch.equal(share[f"{layer}.mlp.down_proj"], w[f"{layer}.mlp.down_proj"][:, half])
    if scheme == "FP8":
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            want = max(f.get_tensor(f"model.layers.0.self_attn.{p}_proj.input_scale").item() for p in "qkv")
        assert whole.layers[0].self_attn.qkv_proj.input_scale.item() == want


def test_tinypaged_quantize_reads_back_in_compressed_tensors(tmp_path: Path) -> None:
    """`tinypaged quantize` writes what compressed-tensors (through transformers) decompresses to exactly the
    weights tinypaged runs, within FP8's rounding of the original; `--quantization fp8` at load is the same."""
    src = tmp_path / "f32"
    original = _hf_model()
    original.save_pretrained(src)
    (src / "tokenizer.json").write_text("{}")
    out = tmp_path / "fp8"
    assert main(["quantize", "--model", str(src), "--out", str(out)]) == 0
    assert (out / "tokenizer.json").read_text() == "{}"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]

    ours = load_model(ModelConfig.from_dir(out), torch.float32, torch.device("cpu"), 64)
    online = load_model(ModelConfig.from_dir(src), torch.float32, torch.device("cpu"), 64, quantization="fp8")
    for (n, a), (_, b) in zip(ours.named_parameters(), online.named_parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a.float(), b.float()), n
    decompress = transformers.CompressedTensorsConfig(dequantize=True)
    decompressed = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=decompress
    )
    assert decompressed.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    mine = _dequantized(ours)
    for i in range(2):
        theirs = {m: getattr(decompressed.model.layers[i], m.split(".")[0]) for m in ("self_attn", "mlp")}
        orig = {m: getattr(original.model.layers[i], m.split(".")[0]) for m in ("self_attn", "mlp")}
        for fused, names in (("self_attn.qkv_proj", "qkv"), ("mlp.gate_up_proj", ("gate", "up"))):
            block = "self_attn" if fused.startswith("self") else "mlp"
            got = torch.cat([getattr(theirs[block], f"{p}_proj").weight for p in names])
            assert torch.equal(got, mine[f"layers.{i}.{fused}"])
            before = torch.cat([getattr(orig[block], f"{p}_proj").weight for p in names])
            scale = before.abs().amax(1, keepdim=True) / 448
            assert ((got - before).abs() <= before.abs() / 16 + scale / 2**9).all()
    assert torch.equal(decompressed.lm_head.weight, original.lm_head.weight)
    assert main(["quantize", "--model", str(out), "--out", str(tmp_path / "again")]) == 2  # already quantized


def test_tinypaged_quantize_bad_paths_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model directory that is not there, or an output that cannot be created: one line, exit status 2,
    nothing written."""
    src = tmp_path / "f32"
    _hf_model().save_pretrained(src)
    (tmp_path / "a-file").write_text("")
    capsys.readouterr()  # transformers' progress bar
    cases = [
        (tmp_path / "missing", tmp_path / "out", "model directory not found"),
        (tmp_path / "a-file", tmp_path / "out", "model directory not found"),
        (src, tmp_path / "a-file" / "out", "cannot write"),
    ]
    for model, out, why in cases:
        assert main(["quantize", "--model", str(model), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "f32"]


UNSUPPORTED = {
    "nvfp4": (
        {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
         "config_groups": {"g": preset_name_to_scheme("NVFP4", ["Linear"]).model_dump()}},
        "NVFP4",
    ),
    "int4-activations": (
        {"quant_method": "compressed-tensors", "format": "int-quantized",
         "config_groups": {"g": preset_name_to_scheme("W4A4", ["re:.*down_proj"]).model_dump()}},
        "W4A4",
    ),
    "unknown-method": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    "fp8-e5m2": ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt e5m2"),
    "fp8-group-weights": (
        {"quant_method": "compressed-tensors", "format": "float-quantized",
         "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                      "strategy": "group", "group_size": 64}}}},
        "strategy 'group'",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_scheme_fails_in_one_line_before_loading(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture
) -> None:
    """No weights are written at all: the refusal comes from config.json alone, naming the scheme and a layer."""
    qc, scheme = UNSUPPORTED[case]
    config = _hf_model().config.to_dict() | {"quantization_config": qc}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        EngineConfig(model=tmp_path)
    layer = "mlp.down_proj" if case == "int4-activations" else "model.layers.0.self_attn.q_proj"
    assert scheme in str(err.value) and layer in str(err.value)
    assert main(["generate", "--model", str(tmp_path), "hi"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and scheme in lines[0]


def test_requested_fp8_on_a_compressed_tensors_checkpoint_is_refused(tmp_path: Path) -> None:
    path = _write_with_compressed_tensors(tmp_path, "FP8_DYNAMIC")
    with pytest.raises(ConfigError, match="already quantized with 'compressed-tensors'"):
        EngineConfig(model=path, quantization="fp8")


def test_fp8_weights_without_a_quantization_config_are_refused(tmp_path: Path) -> None:
    path = _write_with_compressed_tensors(tmp_path, "FP8_DYNAMIC")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="weight_scale|float8"):
        load_model(ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), 64)


@pytest.mark.parametrize("quantization", ["fp8", "int4", "int8"])
def test_engine_runs_quantization_at_load(
    tmp_path: Path, model_dir: Path, run_paged, quantization: str
) -> None:
    """`quantization="fp8"` (and the weight-only "int4" and "int8", tests/model/test_lowbit.py) reaches the
    model through the engine: its greedy tokens are the argmax of the quantized model loaded directly, run
    here over the prompt and those tokens in one pass (a tiny random model with the default model's
    tokenizer)."""
    import shutil

    from tinypaged import LLM, SamplingParams

    path = tmp_path / "tiny"
    _hf_model(vocab=49152).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(model_dir / name, path / name)
    prompt = [1, 504, 3458, 314, 4649, 282]
    with LLM(model=path, quantization=quantization, max_model_len=64, max_num_batched_tokens=64) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=6, temperature=0))[0]
    tokens = list(out.outputs[0].token_ids)
    model = load_model(
        ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), 64, quantization=quantization
    )
    down = model.layers[0].mlp.down_proj
    assert (down.weight.dtype == torch.float8_e4m3fn) if quantization == "fp8" else down.group == 32
    logits = run_paged(model, [prompt + tokens[:-1]], 16, [[]])[0]
    assert len(tokens) == 6 and logits[len(prompt) - 1 :].argmax(-1).tolist() == tokens


def test_cpu_dequantization_is_torchs_cast() -> None:
    """The CPU's fast path through float16 bits gives torch's own float8 cast, times the scale, for every
    E4M3 code but the two NaNs (subnormals included)."""
    from tinypaged.model.quant.fp8 import dequantize

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.tensor([[0.37], [1e-3], [3.0], [2.0**-20]])
    want, got = codes.float() * scales, dequantize(codes, scales)
    finite = ~want.isnan()
    assert finite.sum() == 4 * 254 and torch.equal(got[finite], want[finite])
