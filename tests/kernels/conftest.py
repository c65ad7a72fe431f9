"""Kernel tests run the Triton kernels on the CPU in Triton's interpreter, switched on before any import."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.exit(
        "tests/kernels needs Triton's interpreter, switched on before triton is imported: "
        "run `TRITON_INTERPRET=1 pytest tests/kernels` (as its own pytest process)",
        returncode=4,
    )


def pytest_configure(config: pytest.Config) -> None:
    """Quiet the interpreter's per-loop warning about `range()` bounds (harmless with numpy < 2.4)."""
    quiet = "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
    config.addinivalue_line("filterwarnings", quiet)
