"""benchmarks/paper_kernels.py's checks on the CPU (the interpreter, float32, tiny contexts): the contiguous SDPA
it times the paged kernel against computes the same attention, at every block size of its sweep, so that the
H200 run times two equal computations."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kernel_speed as kb  # noqa: E402
import paper_kernels  # noqa: E402


@pytest.mark.parametrize("heads", [(4, 2, 16), (2, 2, 32)])
def test_paged_against_contiguous_sdpa(monkeypatch: pytest.MonkeyPatch, heads: tuple[int, int, int]) -> None:
    monkeypatch.setattr(kb, "DEV", "cpu")
    monkeypatch.setattr(kb, "DT", torch.float32)
    monkeypatch.setattr(kb, "graph_ms", lambda fns: 1.0)  # no timing on the CPU
    monkeypatch.setattr(paper_kernels, "decode_contexts", lambda name, batch, seed: [5, 17, 33][:batch])
    row = paper_kernels.one_shape(heads, "alpaca", 3, [1, 4, 16], seed=0)
    assert row["rel_err_16"] < 1e-5, row
    assert all(row["by_block_size"][str(b)]["rel_err"] < 1e-5 for b in (1, 4, 16)), row
    assert row["ok"] and row["max_ctx"] == 34
    text = paper_kernels.kernel_table(
        {"heads": heads, "block_sizes": [1, 4, 16], "rows": [row], "all_ok": True}
    )
    assert "alpaca" in text and "bs16" in text


def test_decode_contexts_follow_the_shape() -> None:
    ctx = paper_kernels.decode_contexts("sharegpt", 256, seed=0)
    assert len(ctx) == 256 and min(ctx) >= 2 and max(ctx) <= 2048
    assert 161 < sum(ctx) / len(ctx) < 161 + 338  # the prompt plus part of the output, on average
