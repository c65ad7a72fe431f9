"""One `tinypaged serve` process on the default model for the load tools' tests, with tight limits the soak
pushes past (a queue of 8 sequences, an idle timeout of 3 s, bodies of 256 KiB); the tools under test are
imported from loadtest/ as scripts import them (their folder first on sys.path)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"
sys.path.insert(0, str(LOADTEST))

from tinypaged.server.local import LocalServer  # noqa: E402

API_KEY = "load-key"
LIMITS = {"max_num_seqs": 8, "max_queue_len": 8, "idle_timeout": 3, "max_body_bytes": 256 * 1024}


@pytest.fixture
def api_key() -> str:
    """The live server's API key (a fixture: test modules cannot import conftest, tests/server has one too)."""
    return API_KEY


@pytest.fixture
def limits() -> dict:
    """The live server's limits."""
    return dict(LIMITS)


@pytest.fixture(scope="package")
def live(model_dir: Path) -> Iterator[LocalServer]:
    """The server, as an operator starts one; it must shut down cleanly (exit 0) at the end."""
    flags = ["--model", str(model_dir), "--max-model-len", "512", "--api-key", API_KEY]
    for name, value in LIMITS.items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    server = LocalServer(flags)
    with server:
        yield server
        assert server.stop() == 0
