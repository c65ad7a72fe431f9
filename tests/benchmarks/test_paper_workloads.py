"""The paper's workloads (benchmarks/paper_workloads.py): the fitted shapes have the paper's means, checked
against a brute-force sum over every (input, output) pair rather than the module's own reduction; samples follow
the fit; the dataset readers read the two formats; arrivals are Poisson."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from paper_workloads import (
    PAPER_MEANS,
    file_workload,
    fit_paper_shape,
    paper_workload,
    poisson_arrivals,
    read_alpaca,
    read_sharegpt,
)

DATA = Path(__file__).parent / "data"


def words(text: str) -> list[int]:
    """A tokenizer of one token per word: fixture lengths are known by reading them."""
    return list(range(len(text.split())))


def kept_pairs(fit) -> np.ndarray:
    """P(input = i, output = o) over every pair, zero past the cap, normalized: the reference distribution."""
    n = fit.max_len - 1
    joint = np.outer(fit.p_in, fit.p_out)
    i, o = np.meshgrid(np.arange(1, n + 1), np.arange(1, n + 1), indexing="ij")
    joint[i + o > fit.max_len] = 0.0
    return joint / joint.sum()


@pytest.mark.parametrize(
    ("name", "max_len", "scale"), [("sharegpt", 2048, 1.0), ("alpaca", 2048, 1.0), ("sharegpt", 256, 0.1)]
)
def test_fit_has_the_paper_means(name: str, max_len: int, scale: float) -> None:
    fit = fit_paper_shape(name, max_len, scale)
    joint = kept_pairs(fit)
    lengths = np.arange(1, max_len)
    want_in, want_out = (scale * m for m in PAPER_MEANS[name])
    assert (lengths * joint.sum(1)).sum() == pytest.approx(want_in, rel=1e-5)
    assert (lengths * joint.sum(0)).sum() == pytest.approx(want_out, rel=1e-5)
    assert fit.means() == pytest.approx((want_in, want_out), rel=1e-5)


def test_the_paper_ratios() -> None:
    # The paper's text: ShareGPT has 8.4x longer inputs and 5.8x longer outputs than Alpaca on average.
    (si, so), (ai, ao) = PAPER_MEANS["sharegpt"], PAPER_MEANS["alpaca"]
    assert round(si / ai, 1) == 8.4 and round(so / ao, 1) == 5.8


@pytest.mark.parametrize("name", ["sharegpt", "alpaca"])
def test_samples_follow_the_fit(name: str) -> None:
    work = paper_workload(name, 20000, seed=3)
    p, o = np.array(work.prompt_lens), np.array(work.output_lens)
    assert p.min() >= 1 and o.min() >= 1 and (p + o).max() <= 2048
    mean_in, mean_out = PAPER_MEANS[name]
    assert p.mean() == pytest.approx(mean_in, rel=0.04)
    assert o.mean() == pytest.approx(mean_out, rel=0.04)
    joint = kept_pairs(fit_paper_shape(name))
    for got, marginal in ((p, joint.sum(1)), (o, joint.sum(0))):
        cdf = np.cumsum(marginal)
        for q in (0.5, 0.9):
            exact = int(np.searchsorted(cdf, q)) + 1  # the smallest length whose CDF reaches q
            assert abs(np.quantile(got, q) - exact) <= max(2, 0.05 * exact)
    assert work.summary()["requests"] == 20000


def test_sharegpt_is_the_wider_shape() -> None:
    # "with higher variance": the assumed spreads keep that order.
    share, alpaca = paper_workload("sharegpt", 5000, seed=1), paper_workload("alpaca", 5000, seed=1)
    assert np.std(share.prompt_lens) > np.std(alpaca.prompt_lens)
    assert np.std(share.output_lens) > np.std(alpaca.output_lens)


def test_same_seed_same_requests() -> None:
    assert paper_workload("alpaca", 50, seed=7) == paper_workload("alpaca", 50, seed=7)
    assert paper_workload("alpaca", 50, seed=7) != paper_workload("alpaca", 50, seed=8)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload shape"):
        fit_paper_shape("lmsys")
    with pytest.raises(ValueError, match="too short"):
        fit_paper_shape("sharegpt", max_len=512)


def test_read_sharegpt() -> None:
    # The first turn and its reply; a conversation of fewer than two turns is skipped.
    assert read_sharegpt(DATA / "sharegpt_tiny.json", words) == [(3, 4), (1, 8)]


def test_read_alpaca() -> None:
    # The instruction, and the input on its own line when there is one.
    assert read_alpaca(DATA / "alpaca_tiny.json", words) == [(6, 4), (5, 1), (4, 17)]


def test_file_workload_keeps_what_fits() -> None:
    work = file_workload("alpaca", DATA / "alpaca_tiny.json", words, n=6, seed=0, max_len=20)
    assert len(work.prompt_lens) == 6  # drawn with replacement: the file has fewer that fit
    assert set(zip(work.prompt_lens, work.output_lens, strict=True)) <= {(6, 4), (5, 1)}
    assert work.source.endswith("alpaca_tiny.json")
    with pytest.raises(ValueError, match="fits"):
        file_workload("sharegpt", DATA / "sharegpt_tiny.json", words, n=1, max_len=4)


def test_poisson_arrivals() -> None:
    t = poisson_arrivals(20000, 4.0, np.random.default_rng(0))
    gaps = np.diff(t, prepend=0.0)
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std == mean
    assert (poisson_arrivals(5, float("inf"), np.random.default_rng(0)) == 0).all()
    with pytest.raises(ValueError, match="positive"):
        poisson_arrivals(5, 0.0, np.random.default_rng(0))
