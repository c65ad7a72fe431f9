"""Model and engine configuration: what config.json gives, and the limits an engine config is held to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tinypaged.config import ConfigError, EngineConfig

MISTRAL = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 211,
    "max_position_embeddings": 32768,
}


@pytest.fixture
def model(tmp_path: Path):  # noqa: ANN201
    """A model directory holding only config.json (all EngineConfig reads), MISTRAL with overrides."""

    def make(**overrides: object) -> Path:
        (tmp_path / "config.json").write_text(json.dumps(MISTRAL | overrides))
        return tmp_path

    return make


def test_sliding_window_is_every_layer_s_and_does_not_cap_the_context(model) -> None:
    """The attention runs the window (ops.paged_attention), so a windowed model serves its whole context."""
    cfg = EngineConfig(model=model(sliding_window=4096))
    assert cfg.model_config.layer_windows == (4096, 4096) and cfg.max_model_len == 32768


@pytest.mark.parametrize("window", [None, 0, 32768, 65536])
def test_no_window_or_one_past_the_context(model, window: int | None) -> None:
    # Mistral v0.2+ writes null; a window at least as long as the context never binds.
    cfg = EngineConfig(model=model(sliding_window=window))
    assert cfg.max_model_len == 32768
    with pytest.raises(ConfigError, match=r"exceeds the model's context \(32768 tokens\)"):
        EngineConfig(model=model(sliding_window=window), max_model_len=40000)


def test_cli_flags_are_the_engine_arguments() -> None:
    """Every EngineConfig field is a flag of `serve` and `generate`, with the field's default (the server's own,
    SERVE_DEFAULTS, where it has one)."""
    from tinypaged.cli import build_parser
    from tinypaged.config import SERVE_DEFAULTS

    parser = build_parser()
    assert SERVE_DEFAULTS == {"max_num_batched_tokens": 512}
    for command, own in ((["serve"], SERVE_DEFAULTS), (["generate", "x"], {})):
        args = vars(parser.parse_args(command))
        for f in EngineConfig.engine_args():
            assert f.name in args and args[f.name] == own.get(f.name, f.default), f.name
    flags = vars(
        parser.parse_args(["serve", "--block-size", "32", "--no-async-scheduling", "--enforce-eager"])
    )
    assert (flags["block_size"], flags["async_scheduling"], flags["enforce_eager"]) == (32, False, True)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"block_size": 3}, "block_size must be one of"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"preemption_mode": "pause"}, "preemption_mode must be one of"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens must be >= 1"),
        ({"swap_space": -1.0}, "swap_space must be >= 0"),
        ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override must be >= 1"),
        ({"max_num_sequences": 4}, "unknown engine argument 'max_num_sequences'"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        # 4 heads, 2 KV heads, MLP width 96: 3 divides neither the heads nor the KV heads.
        ({"tensor_parallel_size": 3}, r"does not divide its 4 attention heads and its 2 KV heads"),
        ({"tensor_parallel_size": 8}, "does not divide its 4 attention heads"),
        # A value of the wrong type, refused by name (it failed later, in a comparison or in the engine).
        ({"max_model_len": "swap"}, "max_model_len must be int or None; got 'swap'"),
        ({"cpu_kv_cache_space": []}, r"cpu_kv_cache_space must be float; got \[\]"),
        ({"max_num_batched_tokens": {"a": 1}}, "max_num_batched_tokens must be int"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size must be int; got True"),
        ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization must be float; got nan"),
        ({"enable_chunked_prefill": 1}, "enable_chunked_prefill must be bool"),
        ({"device": "int8"}, "device must be auto, cpu, cuda or cuda:N; got 'int8'"),
        ({"device": "cpu:1"}, "device must be auto, cpu, cuda or cuda:N"),
        ({"device": 2}, "device must be str; got 2"),
        (
            {"tokenizer": "/no/such/dir"},
            "tokenizer must be a directory holding tokenizer.json; got '/no/such/dir'",
        ),
        ({"tokenizer": 5}, "tokenizer must be a directory holding tokenizer.json; got 5"),
    ],
)
def test_bad_engine_arguments(model, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_kwargs(model(), **kwargs)


def test_missing_model_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model directory not found"):
        EngineConfig(model=tmp_path / "nope")


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_sizes_that_split(model, tp: int) -> None:
    """2 splits every KV head group; 4 ranks share each of the 2 KV heads by two."""
    assert EngineConfig.from_kwargs(model(), tensor_parallel_size=tp).tensor_parallel_size == tp


def test_tensor_parallel_mlp_must_split(model) -> None:
    with pytest.raises(ConfigError, match="does not divide its MLP width 90"):
        EngineConfig.from_kwargs(model(intermediate_size=90), tensor_parallel_size=4)


DAMAGED = {  # config.json fields a damaged or hand-edited file may hold (found by fuzzing)
    "zero-heads": ({"num_attention_heads": 0}, "ZeroDivisionError|num_attention_heads"),
    "negative-size": ({"hidden_size": -64}, "hidden_size -64 is not a size"),
    "huge-size": ({"head_dim": 2**62}, "head_dim 4611686018427387904 is not a size"),
    "odd-head-dim": ({"head_dim": 3}, "head_dim 3 is odd"),
    "rope-parameters-number": ({"rope_parameters": 3}, "AttributeError"),
    "rope-scaling-string": ({"rope_scaling": "llama"}, "rope_scaling 'llama' is not an object"),
    "llama3-without-factor": ({"rope_scaling": {"rope_type": "llama3"}}, "needs a positive factor"),
    "llama3-equal-factors": (
        {"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 2, "high_freq_factor": 2}},
        "high_freq_factor > low_freq_factor",
    ),
    "negative-theta": ({"rope_theta": -1}, "rope_theta -1.0 is not a positive number"),
    "model-type-list": ({"model_type": [1], "architectures": 5}, "unsupported model architecture"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_config_json_is_one_clear_error(model, case: str) -> None:
    overrides, message = DAMAGED[case]
    with pytest.raises(ConfigError, match=message) as err:
        EngineConfig(model=model(**overrides))
    assert "\n" not in str(err.value)


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}
W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "ignore": ["lm_head"],
    "config_groups": {
        "g": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "strategy": "group",
                "group_size": 32,
                "symmetric": True,
            },
        }
    },
}


@pytest.mark.parametrize(
    "checkpoint, asked, name",
    [
        (GPTQ, "gptq", "gptq"),
        (GPTQ, "GPTQ_Marlin", "gptq"),
        (AWQ, "awq_marlin", "awq"),
        (AWQ, "AWQ", "awq"),
        (W4A16, "compressed_tensors", "compressed-tensors"),
        (W4A16 | {"quant_method": "compressed_tensors"}, "compressed-tensors", "compressed-tensors"),
        (W4A16 | {"quant_method": "Compressed_Tensors"}, None, None),
    ],
)
def test_vllm_names_of_a_checkpoint_s_own_format_run_it(model, checkpoint: dict, asked, name) -> None:
    """vLLM users pass the checkpoint's format as `quantization` (any case; gptq_marlin / awq_marlin, vLLM's
    kernels for GPTQ / AWQ; compressed_tensors): it names the format the checkpoint must have, and runs it."""
    cfg = EngineConfig(model=model(quantization_config=checkpoint), quantization=asked)
    assert cfg.quantization == name
    from tinypaged.quantization import IntScheme, resolve_quantization

    quant = resolve_quantization(checkpoint, cfg.quantization, "m", 2, True)
    assert quant is not None and len(quant.layers) == 2 * 7
    assert all(isinstance(s, IntScheme) and s.bits == 4 and s.group == 32 for s in quant.layers.values())


@pytest.mark.parametrize(
    "checkpoint, asked, message",
    [
        (
            GPTQ,
            "awq_marlin",
            "quantization 'awq' was asked for, but the checkpoint is already quantized with 'gptq'",
        ),
        (W4A16, "gptq", "already quantized with 'compressed-tensors'"),
        (
            None,
            "gptq_marlin",
            "quantization 'gptq' runs a checkpoint quantized in that format, and this one has no",
        ),
        (
            None,
            "compressed-tensors",
            r"has no quantization_config \(int4, int8 or fp8 quantize one at load\)",
        ),
        (
            None,
            "bitsandbytes",
            "quantization must be one of fp8, int4, int8, gguf, compressed-tensors, gptq, awq",
        ),
        (None, 4, "quantization must be str or None; got 4"),
    ],
)
def test_a_quantization_the_checkpoint_does_not_have_is_one_clear_error(
    model, checkpoint, asked, message
) -> None:
    path = model(quantization_config=checkpoint) if checkpoint else model()
    with pytest.raises(ConfigError, match=message):
        EngineConfig(model=path, quantization=asked)


def test_a_draft_s_quantization_is_checked_when_the_engine_is_configured(model) -> None:
    """The draft's scheme is resolved with the target's, before any weight is read; its name as the target's."""
    spec = {"method": "draft_model", "num_speculative_tokens": 2}
    cfg = EngineConfig(model=model(), speculative_config=spec | {"quantization": "INT4"})
    assert cfg.speculative is not None and cfg.speculative.quantization == "int4"
    with pytest.raises(ConfigError, match=r"speculative_config: .*quantization 'gptq' runs a checkpoint"):
        EngineConfig(model=model(), speculative_config=spec | {"quantization": "gptq"})
    with pytest.raises(ConfigError, match=r"speculative_config: .*already quantized with 'gptq'"):
        EngineConfig(
            model=model(quantization_config=GPTQ), speculative_config=spec | {"quantization": "int8"}
        )
