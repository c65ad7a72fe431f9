"""The persistent compile cache (tinypaged/compile_cache.py): under the model cache directory unless
TRITON_CACHE_DIR says otherwise; a directory that cannot be written is replaced by a temporary one, corrupt
entries are deleted, each with a warning, never a crash. The round trip uses Triton's real compiler (for sm_90,
which works without a GPU, as tests/test_kernel_compiles.py does): a cache entry corrupted after a compile
makes Triton itself fail, and after the check it compiles again."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from test_kernel_compiles import compile_bitmask_kernel

from tinypaged import compile_cache
from tinypaged.kernels.bitmask import _apply_bitmask_kernel


@pytest.fixture
def cache_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("TINYPAGED_HOME", str(tmp_path / "home"))
    return tmp_path


def _compile() -> None:
    assert "cubin" in compile_bitmask_kernel().asm


def test_the_cache_lives_under_the_model_cache(cache_env: Path) -> None:
    state = compile_cache.setup()
    assert state.path == cache_env / "home" / "compile" / "triton" and state.path.is_dir()
    assert (state.entries, state.removed, state.fallback) == (0, 0, False)
    assert compile_cache.os.environ[compile_cache.ENV] == str(state.path)


def test_a_set_triton_cache_dir_is_kept(cache_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compile_cache.ENV, str(cache_env / "mine"))
    assert compile_cache.setup().path == cache_env / "mine"


def test_an_unwritable_cache_is_replaced_with_a_warning(
    cache_env: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = cache_env / "file"
    blocked.write_text("not a directory")  # unwritable as a directory, whoever runs the test (root too)
    monkeypatch.setenv(compile_cache.ENV, str(blocked / "triton"))
    with caplog.at_level(logging.WARNING):
        state = compile_cache.setup()
    assert state.fallback and state.path.is_dir() and "cannot be written" in caplog.text
    assert compile_cache.os.environ[compile_cache.ENV] == str(state.path)
    _compile()  # into the temporary directory
    assert any(state.path.iterdir())


def test_corrupt_entries_are_removed_and_compiled_again(
    cache_env: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = compile_cache.setup()
    _compile()
    (entry,) = [e for e in state.path.iterdir() if e.is_dir()]
    assert compile_cache.setup().entries == 1  # a good entry is kept
    meta = next(f for f in entry.iterdir() if f.suffix == ".json" and not f.name.startswith("__grp__"))
    meta.write_text('{"name": "_apply_bitmask_kernel", "trunc')  # a torn write, a disk error
    with pytest.raises(json.JSONDecodeError):
        _compile()  # what Triton itself does with it
    # Other kinds of damage, in entries of their own.
    (state.path / "empty").mkdir()
    (state.path / "empty" / "k.cubin").write_bytes(b"")
    (state.path / "orphan").mkdir()
    group = {"child_paths": {"k.cubin": str(state.path / "orphan" / "gone.cubin")}}
    (state.path / "orphan" / "__grp__k.json").write_text(json.dumps(group))
    with caplog.at_level(logging.WARNING):
        again = compile_cache.setup()
    assert (again.entries, again.removed) == (0, 3) and caplog.text.count("is corrupt") == 3
    _compile()  # rebuilt
    assert compile_cache.setup().entries == 1


def test_an_unlistable_cache_is_left_alone(cache_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Path):  # noqa: ANN202 - Path.iterdir's stand-in
        raise PermissionError("denied")

    compile_cache.setup()
    monkeypatch.setattr(Path, "iterdir", refuse)
    state = compile_cache.setup()
    assert (state.entries, state.removed) == (0, 0)


def test_a_moved_cache_is_used_where_it_is(cache_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's group files name the kernel's files by absolute path: a cache filled elsewhere (a VM image built
    under another TINYPAGED_HOME) is repaired, not thrown away."""
    monkeypatch.setenv(compile_cache.ENV, str(cache_env / "built"))
    compile_cache.setup()
    _compile()
    (cache_env / "built").rename(cache_env / "moved")
    monkeypatch.setenv(compile_cache.ENV, str(cache_env / "moved"))
    state = compile_cache.setup()
    assert (state.entries, state.removed) == (1, 0)
    (entry,) = [e for e in state.path.iterdir() if e.is_dir()]
    (group,) = entry.glob("__grp__*.json")
    assert all(p.startswith(str(entry)) for p in json.loads(group.read_text())["child_paths"].values())
    before = {f: f.stat().st_mtime_ns for f in entry.iterdir()}
    _compile()  # a cache hit: nothing rewritten
    assert {f: f.stat().st_mtime_ns for f in entry.iterdir()} == before


def test_compile_only_turns_launches_into_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `compile_only` a launch reaches Triton as a warmup (compile, no launch), inside Triton's async
    compile mode; the launch is itself again afterwards. (Triton's compile of a launch needs a GPU driver: the
    real thing runs in the GPU warm-up, which falls back to compiling one at a time if it fails.)"""
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction

    seen = []

    def run(self: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> None:
        seen.append((self.__name__, warmup, _async_compile.active_mode.get() is not None))

    monkeypatch.setattr(JITFunction, "run", run)
    assert not compile_cache.compiling_only()
    with compile_cache.compile_only(workers=2):
        assert compile_cache.compiling_only()  # a draft model captures no CUDA graph in a dry run
        _apply_bitmask_kernel[(1,)](None, 0, None, 0, None, 0, BLOCK=32)
    assert not compile_cache.compiling_only()
    _apply_bitmask_kernel[(1,)](None, 0, None, 0, None, 0, BLOCK=32)
    assert seen == [("_apply_bitmask_kernel", True, True), ("_apply_bitmask_kernel", False, False)]
