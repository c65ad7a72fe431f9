"""The persistent compile cache: Triton's compiled kernels kept under the model cache directory
(`<TINYPAGED_HOME>/compile/triton`), so that a restart on the same machine loads them instead of compiling them
again, and `tinypaged warmup` can fill it ahead of time (a VM image, a container build).

Triton reads TRITON_CACHE_DIR each time it compiles, so setting it before the first launch is enough; a value
the user set is kept. The cache is checked before use: a directory that cannot be written is replaced by a
fresh temporary one, an entry whose files do not parse or are missing is deleted (Triton compiles it again),
each with a warning, and a cache that was moved (Triton records absolute paths) is pointed at its files: a bad
cache costs compile time, never a crash. `compile_only` turns launches into compiles run side by side, for
the warm-up's dry run. Nothing here imports torch, nor Triton at import. (torch's inductor is not used by
tinypaged: it has no cache to keep.)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "TRITON_CACHE_DIR"


@dataclass(frozen=True)
class CacheState:
    """Where Triton's cache is and what was in it when the engine started."""

    path: Path
    entries: int  # compiled kernels found (Triton's cache directories)
    removed: int  # entries deleted as corrupt
    fallback: bool  # the configured directory was unusable: a temporary one is used instead

    def describe(self) -> str:
        """One line for the startup log."""
        note = f", {self.removed} corrupt removed" if self.removed else ""
        note += " (a temporary directory: the configured one was unusable)" if self.fallback else ""
        return f"{self.path} ({self.entries} kernels cached{note})"


def default_dir() -> Path:
    """`<TINYPAGED_HOME>/compile/triton`: beside the models, kept with them."""
    from tinypaged.weights.fetch import tinypaged_home

    return tinypaged_home() / "compile" / "triton"


def setup() -> CacheState:
    """Point Triton's cache at the persistent directory (TRITON_CACHE_DIR if set, else `default_dir()`), checked
    and cleaned; call it before anything compiles. Never raises for a bad cache."""
    path = Path(os.environ.get(ENV) or default_dir()).expanduser()
    fallback = False
    if not _writable(path):
        fallback = True
        bad = path
        path = Path(tempfile.mkdtemp(prefix="tinypaged-triton-"))
        logger.warning("the compile cache %s cannot be written: using %s (kernels compile afresh)", bad, path)
    entries, removed = _clean(path)
    os.environ[ENV] = str(path)
    return CacheState(path, entries, removed, fallback)


def _writable(path: Path) -> bool:
    """Whether `path` is (or can be made) a directory this process writes and reads back."""
    probe = path / f".probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        ok = probe.read_bytes() == b"ok"
        probe.unlink()
        return ok and os.access(path, os.R_OK | os.W_OK | os.X_OK)
    except OSError:
        return False


def _clean(path: Path) -> tuple[int, int]:
    """Delete the cache entries Triton would fail on: a directory (one compiled kernel) with a JSON file that does
    not parse, an empty file, or a group file naming a file that is not there (a moved entry's group is pointed
    at its files). Returns (entries kept, removed)."""
    kept = removed = 0
    try:
        entries = [e for e in path.iterdir() if e.is_dir()]
    except OSError as e:
        logger.warning("the compile cache %s cannot be listed (%s): it is left as it is", path, e)
        return 0, 0
    for entry in entries:
        why = _fault(entry)
        if why is None:
            kept += 1
            continue
        logger.warning("compile cache entry %s is corrupt (%s): removed, it compiles again", entry.name, why)
        shutil.rmtree(entry, ignore_errors=True)
        removed += 1
    return kept, removed


def _fault(entry: Path) -> str | None:
    """What is wrong with one cache entry (None: nothing)."""
    try:
        files = [f for f in entry.iterdir() if f.is_file()]
        for f in files:
            if f.name == "lock":
                continue
            if f.stat().st_size == 0:
                return f"{f.name} is empty"
            if f.suffix != ".json":
                continue
            data = json.loads(f.read_text())
            if f.name.startswith("__grp__"):
                children = data.get("child_paths") if isinstance(data, dict) else None
                if not isinstance(children, dict):
                    return f"{f.name} lists no files"
                # Triton names a kernel's files by absolute path: a cache moved elsewhere (a VM image, another
                # TINYPAGED_HOME) is pointed at its files where they are now.
                here = {c: str(entry / Path(p).name) for c, p in children.items()}
                missing = [c for c, p in here.items() if not os.path.isfile(p)]
                if missing:
                    return f"{f.name} names missing files ({', '.join(sorted(missing))})"
                if here != children:
                    f.write_text(json.dumps({"child_paths": here}))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def dry_run(run: Callable[[], object], what: str) -> None:
    """`run()` under `compile_only` (the kernels it launches compile side by side), unless
    TINYPAGED_PARALLEL_COMPILE=0; a failure is logged and left for the real run that must follow."""
    if os.environ.get("TINYPAGED_PARALLEL_COMPILE") == "0":
        return
    try:
        with compile_only():
            run()
    except Exception as e:  # noqa: BLE001 - the real run compiles (and reports) what is left
        logger.warning("%s: the parallel compiles failed (%s): compiling one at a time", what, e)


_dry = False  # whether `compile_only` is active


def compiling_only() -> bool:
    """Whether a dry run (`compile_only`) is active: its launches run nothing, so nothing may be captured."""
    return _dry


@contextlib.contextmanager
def compile_only(workers: int = 0) -> Iterator[None]:
    """While active, a Triton kernel's launch only submits its compile to a pool of `workers` threads (default:
    the cores, up to 16) and returns at once, launching nothing; on exit every compile is waited for, and the
    compiled kernels are in Triton's caches (memory and disk) for the launches after it. Compiles then run side
    by side where one kernel at a time would wait for each (their passes and ptxas release the interpreter
    lock). What the launches would have written is left unwritten: only a dry run of work whose results are
    thrown away may run under it. A compile that fails here is left for the real launch to report."""
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.jit import JITFunction

    launch = JITFunction.run

    def submit(self: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> object:
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    workers = workers or max(1, min(16, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="tinypaged-compile") as pool:
        with AsyncCompileMode(pool, ignore_errors=True):
            global _dry
            JITFunction.run = submit  # type: ignore[method-assign]
            _dry = True
            try:
                yield
            finally:
                _dry = False
                JITFunction.run = launch  # type: ignore[method-assign]
