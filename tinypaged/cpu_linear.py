"""The CPU's float32 matmul at a few rows, the way this machine's BLAS runs it fastest.

`ops.linear` computes `x @ W^T` for x `[M, K]` and a row-major weight `[N, K]`. torch hands a one-row product to
the BLAS as a matrix-vector product (sgemv) and a few rows to sgemm with the weight as the transposed operand.
How fast each runs depends on the BLAS and the processor: on a 2-core AMD EPYC (Zen 4, MKL) a decode step's
layers streamed at 16 GB/s at one row and 9-11 GB/s at two to four, while the same product taken the other way
round, `(W @ x^T)^T` (the weight as the plain left operand, the rows as a thin right one), streamed at 31-35 GB/s
at two to four rows; one row, doubled to two, the same. On a 2-core Xeon the one-row sgemv already runs near
the memory's speed (benchmarks/NOTES.md, "The CPU's matmuls at a few rows").

So the choice is measured, once a process, when a CPU engine whose model runs float32 products starts (or else
the first time a float32 product of a few rows runs on the CPU: `transposed_rows`). For each row count up to
`MAX_ROWS`, a weight of `_SHAPE` in `_COPIES` copies (past the caches, as a step's layers are) is multiplied both
ways, and the transposed way is taken at the row counts where it takes at most `_MARGIN` of F.linear's time, so
that timing noise does not flip a choice that barely matters. It takes about half a second.
`TINYPAGED_CPU_TRANSPOSED=0` never takes it, `=1` always does up to `MAX_ROWS` (tests, side-by-side measurements).

Both ways sum each output in float32 over K, in orders that differ by an ulp or so (as sgemv's and sgemm's
already did); the BLAS may also sum a row differently at two columns than at four, as it may at one row and
several either way.
"""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.nn.functional as F

# Row counts considered; more rows stay with F.linear (from 5 the two ways trade places by shape).
MAX_ROWS = 4
_SHAPE = (2048, 1024)  # the calibration weight [N, K]: 8 MB in float32
_COPIES = 16  # 128 MB: read from memory, not cache, as a step's layers are
_MARGIN = 0.8  # the transposed way must take at most this share of F.linear's time
_REPEATS = 5


def small_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`x @ weight^T (+ bias)` the transposed way where this machine runs it faster (`transposed_rows`); None
    where `ops.linear` should go on as it does (other devices, dtypes, layouts or row counts)."""
    rows = x.shape[0]
    if (
        rows > MAX_ROWS
        or rows < 1
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.dim() != 2
        or not weight.is_contiguous()
        or rows not in transposed_rows()
    ):
        return None
    return _transposed(x, weight, bias)


def _transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`(W @ x^T)^T`, a single row doubled (sgemm, not sgemv), returned contiguous `[M, N]`."""
    rows = x.shape[0]
    xt = (torch.cat([x, x]) if rows == 1 else x).t()
    y = torch.matmul(weight, xt).t()[:rows].contiguous()
    return y if bias is None else y + bias


@functools.cache
def transposed_rows() -> frozenset[int]:
    """The row counts at which this process takes the transposed product (see the module docstring)."""
    forced = os.environ.get("TINYPAGED_CPU_TRANSPOSED", "auto")
    if forced in ("0", "1"):
        return frozenset(range(1, MAX_ROWS + 1)) if forced == "1" else frozenset()
    return frozenset(r for r, (plain, turned) in measure().items() if turned <= _MARGIN * plain)


def measure(row_counts: range = range(1, MAX_ROWS + 1)) -> dict[int, tuple[float, float]]:
    """Seconds of one pass over `_COPIES` weights of `_SHAPE`, by row count: (F.linear, the transposed way); the
    fastest of `_REPEATS` after a first pass each, the two ways alternating (the fastest: on a shared machine a
    neighbour's load only ever adds time)."""
    weights = [torch.full(_SHAPE, 1.0 / _SHAPE[1]) for _ in range(_COPIES)]
    out = {}
    with torch.inference_mode():
        for rows in row_counts:
            x = torch.ones(rows, _SHAPE[1])
            runs: tuple[list[float], list[float]] = ([], [])
            for rep in range(_REPEATS + 1):
                for way, f in enumerate((F.linear, lambda a, w: _transposed(a, w, None))):
                    t0 = time.perf_counter()
                    for w in weights:
                        f(x, w)
                    if rep:
                        runs[way].append(time.perf_counter() - t0)
            out[rows] = (min(runs[0]), min(runs[1]))
    return out
