"""The CPU's float32 product at a few rows taken the transposed way (`tinypaged.cpu_linear`): the same product as
F.linear to float32 rounding (a row alone, doubled into two columns, too), the choice measured once a process and
overridden by TINYPAGED_CPU_TRANSPOSED."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinypaged import cpu_linear, ops


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch):
    """The transposed way at every row count it considers, whatever this machine measured."""
    monkeypatch.setattr(cpu_linear, "transposed_rows", lambda: frozenset(range(1, cpu_linear.MAX_ROWS + 1)))


def test_transposed_product_equals_linear(forced: None) -> None:
    torch.manual_seed(0)
    w, b = torch.randn(300, 96), torch.randn(300)
    for rows in range(1, cpu_linear.MAX_ROWS + 1):
        x = torch.randn(rows, 96)
        for bias in (None, b):
            y = cpu_linear.small_rows(x, w, bias)
            assert y is not None and y.shape == (rows, 300) and y.is_contiguous()
            torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
            assert torch.equal(ops.linear(x, w, bias), y)
    x = torch.randn(2, 96)
    pair = cpu_linear.small_rows(x, w, None)
    for i in range(2):  # a row alone is doubled into a two-column product: the pair's arithmetic
        torch.testing.assert_close(cpu_linear.small_rows(x[i : i + 1].clone(), w, None)[0], pair[i])


def test_other_products_keep_their_path(forced: None) -> None:
    w = torch.randn(64, 32)
    assert cpu_linear.small_rows(torch.randn(cpu_linear.MAX_ROWS + 1, 32), w, None) is None
    assert cpu_linear.small_rows(torch.randn(2, 32).double(), w.double(), None) is None
    assert cpu_linear.small_rows(torch.randn(2, 32).bfloat16(), w.bfloat16(), None) is None
    assert cpu_linear.small_rows(torch.randn(2, 32), w.t().contiguous().t(), None) is None  # a strided view
    assert cpu_linear.small_rows(torch.randn(0, 32), w, None) is None


def test_the_choice_is_measured_once_or_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_linear, "_SHAPE", (64, 32))
    monkeypatch.setattr(cpu_linear, "_COPIES", 2)
    times = cpu_linear.measure(range(1, 3))
    assert set(times) == {1, 2} and all(a > 0 and b > 0 for a, b in times.values())
    for value, want in (("0", frozenset()), ("1", frozenset(range(1, cpu_linear.MAX_ROWS + 1)))):
        monkeypatch.setenv("TINYPAGED_CPU_TRANSPOSED", value)
        cpu_linear.transposed_rows.cache_clear()
        assert cpu_linear.transposed_rows() == want
    monkeypatch.setenv("TINYPAGED_CPU_TRANSPOSED", "auto")
    cpu_linear.transposed_rows.cache_clear()
    rows = cpu_linear.transposed_rows()
    assert rows <= set(range(1, cpu_linear.MAX_ROWS + 1)) and cpu_linear.transposed_rows() is rows
    cpu_linear.transposed_rows.cache_clear()
