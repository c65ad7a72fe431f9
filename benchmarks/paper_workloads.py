"""The vLLM paper's workloads (Kwon et al., SOSP 2023, section 6.1): ShareGPT- and Alpaca-shaped prompt and
output lengths, and Poisson arrivals.

The paper tokenizes the two datasets and keeps only each request's input and output lengths; request times are
drawn from a Poisson process at each rate. The datasets cannot be downloaded here, so each shape is a
distribution fitted to the paper's published statistics; a user who has a dataset file passes it instead
(`read_sharegpt`, `read_alpaca`).

What the paper publishes (Fig. 11, and its text: "the ShareGPT dataset has 8.4x longer input prompts and 5.8x
longer outputs on average than the Alpaca dataset, with higher variance"):

    ShareGPT: mean input 161.31 tokens, mean output 337.99 tokens
    Alpaca:   mean input  19.31 tokens, mean output  58.45 tokens

(the means are the labels of Fig. 11's histograms, OPT's tokenizer; their ratios, 8.35 and 5.78, are the
8.4x and 5.8x of the text). The paper gives no spread but the histograms and "higher variance"; the shapes'
spreads below are our assumption, stated as log-normal sigmas (`SIGMAS`).

The fit: each length is a log-normal of the given sigma, rounded to whole tokens (a length L holds the mass
of (L - 1/2, L + 1/2]; 1 takes everything below 1.5), drawn independently for input and output, and a pair is
kept only when input + output <= max_len (the paper's 2048: the dataset's requests that fit the model; the
rejection is what a dataset filter does). The two log-normal mus are solved so that the means of the kept
pairs are the paper's means exactly (`LengthFit.means`, computed in closed form over the discrete
distributions, no sampling). With `scale` < 1 the targets shrink by that factor: the same shapes, small enough
for a CPU smoke run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

# (mean input, mean output) in tokens: the vLLM paper, Fig. 11.
PAPER_MEANS = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}
# (input, output) log-normal sigmas: our assumption (the paper publishes histograms, not spreads). ShareGPT's
# long tails (chat turns of a few tokens to thousands) against Alpaca's short, narrow instructions.
SIGMAS = {"sharegpt": (1.2, 1.0), "alpaca": (0.6, 0.9)}
PAPER_MAX_LEN = 2048  # the paper's max_model_len


def _lognormal_pmf(mu: float, sigma: float, n: int) -> np.ndarray:
    """P(L) for L = 1..n of a log-normal rounded to whole tokens (L = 1 takes all mass below 1.5; the tail
    past n is dropped: the length cap rejects it anyway)."""
    edges = np.log(np.arange(1, n + 1) + 0.5)
    z = (edges - mu) / (sigma * math.sqrt(2.0))
    cdf = 0.5 * (1.0 + np.array([math.erf(x) for x in z]))
    return np.diff(cdf, prepend=0.0)


@dataclass(frozen=True)
class LengthFit:
    """A fitted pair of length distributions: `p_in[L - 1]`, `p_out[L - 1]` before the cap, and the cap on
    input + output."""

    name: str
    mu: tuple[float, float]
    sigma: tuple[float, float]
    max_len: int
    p_in: np.ndarray
    p_out: np.ndarray

    @classmethod
    def of(cls, name: str, mu: tuple[float, float], sigma: tuple[float, float], max_len: int) -> LengthFit:
        """The distributions of these parameters (lengths 1..max_len - 1)."""
        n = max_len - 1
        return cls(
            name, mu, sigma, max_len, _lognormal_pmf(mu[0], sigma[0], n), _lognormal_pmf(mu[1], sigma[1], n)
        )

    def means(self) -> tuple[float, float]:
        """Exact means of input and output length over the pairs the cap keeps."""
        lengths = np.arange(1, self.max_len)
        # A pair (i, o) is kept when o <= max_len - i: weight of input i is p_in[i] * P(out <= max_len - i).
        out_cdf, in_cdf = np.cumsum(self.p_out), np.cumsum(self.p_in)
        w_in = self.p_in * out_cdf[::-1]  # out_cdf[max_len - 1 - i] for i = 1..max_len-1
        w_out = self.p_out * in_cdf[::-1]
        kept = w_in.sum()
        return float((lengths * w_in).sum() / kept), float((lengths * w_out).sum() / kept)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """`n` (input, output) length pairs, drawn independently and kept under the cap."""
        lengths = np.arange(1, self.max_len)
        ins: list[np.ndarray] = []
        outs: list[np.ndarray] = []
        have = 0
        while have < n:
            i = rng.choice(lengths, size=2 * n, p=self.p_in / self.p_in.sum())
            o = rng.choice(lengths, size=2 * n, p=self.p_out / self.p_out.sum())
            keep = i + o <= self.max_len
            ins.append(i[keep])
            outs.append(o[keep])
            have += int(keep.sum())
        return np.concatenate(ins)[:n], np.concatenate(outs)[:n]


@cache
def fit_paper_shape(
    name: str, max_len: int = PAPER_MAX_LEN, scale: float = 1.0, sigma: tuple[float, float] | None = None
) -> LengthFit:
    """The log-normals whose capped means are `scale` x the paper's means for `name` ("sharegpt" or "alpaca").

    Solved by the fixed point mu += log(target / mean) for both mus together: an uncapped log-normal's mean is
    exp(mu + sigma^2 / 2), so the step is exact without the cap and converges in a few rounds with it.
    """
    if name not in PAPER_MEANS:
        raise ValueError(f"unknown workload shape {name!r}; choose from {', '.join(PAPER_MEANS)}")
    target = tuple(scale * m for m in PAPER_MEANS[name])
    if min(target) <= 1.05:
        raise ValueError(
            f"scale {scale:g} leaves {name} a mean length of {min(target):.2f}: lengths are >= 1"
        )
    if sum(target) >= max_len / 2:
        raise ValueError(f"max_len {max_len} is too short for means {target[0]:.1f} + {target[1]:.1f}")
    sig = sigma or SIGMAS[name]
    mu = [math.log(t) - s * s / 2 for t, s in zip(target, sig, strict=True)]
    for _ in range(200):
        fit = LengthFit.of(name, (mu[0], mu[1]), sig, max_len)
        got = fit.means()
        if all(abs(g - t) < 1e-6 * t for g, t in zip(got, target, strict=True)):
            return fit
        mu = [m + math.log(t / g) for m, t, g in zip(mu, target, got, strict=True)]
    raise RuntimeError(f"the fit of {name} did not converge (means {got}, targets {target})")


@dataclass(frozen=True)
class Workload:
    """Requests as prompt and output lengths (tokens), and where they came from."""

    name: str
    source: str  # "paper fit (...)" or the dataset file's path
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]

    def summary(self) -> dict[str, float | int | str]:
        """Count, means and quantiles of both lengths, for the result file."""
        p, o = np.array(self.prompt_lens), np.array(self.output_lens)
        return {
            "name": self.name,
            "source": self.source,
            "requests": len(p),
            "mean_input": float(p.mean()),
            "mean_output": float(o.mean()),
            "p50_input": float(np.median(p)),
            "p50_output": float(np.median(o)),
            "p99_input": float(np.quantile(p, 0.99)),
            "p99_output": float(np.quantile(o, 0.99)),
        }


def paper_workload(
    name: str, n: int, seed: int = 0, max_len: int = PAPER_MAX_LEN, scale: float = 1.0
) -> Workload:
    """`n` requests of the fitted `name` shape."""
    fit = fit_paper_shape(name, max_len, scale)
    ins, outs = fit.sample(n, np.random.default_rng(seed))
    source = f"paper fit (log-normal sigmas {fit.sigma}, scale {scale:g}, max_len {max_len})"
    return Workload(name, source, tuple(map(int, ins)), tuple(map(int, outs)))


Encode = Callable[[str], list[int]]


def read_sharegpt(path: str | Path, encode: Encode) -> list[tuple[int, int]]:
    """(prompt, output) token lengths of a ShareGPT JSON file (a list of {"conversations": [{"from", "value"},
    ...]}): each conversation's first turn and the reply after it, as vLLM's serving benchmark reads it;
    conversations of fewer than two turns are skipped."""
    pairs = []
    for item in json.loads(Path(path).read_text()):
        turns = item.get("conversations") or []
        if len(turns) >= 2:
            pairs.append((len(encode(turns[0]["value"])), len(encode(turns[1]["value"]))))
    return pairs


def read_alpaca(path: str | Path, encode: Encode) -> list[tuple[int, int]]:
    """(prompt, output) token lengths of an Alpaca JSON file (a list of {"instruction", "input", "output"}):
    the prompt is the instruction, and the input on a new line when there is one (no prompt template: the
    paper's 19.31-token mean input has no room for one)."""
    pairs = []
    for item in json.loads(Path(path).read_text()):
        prompt = item["instruction"] + (f"\n{item['input']}" if item.get("input") else "")
        pairs.append((len(encode(prompt)), len(encode(item["output"]))))
    return pairs


READERS = {"sharegpt": read_sharegpt, "alpaca": read_alpaca}


def file_workload(
    name: str, path: str | Path, encode: Encode, n: int, seed: int = 0, max_len: int = PAPER_MAX_LEN
) -> Workload:
    """`n` requests drawn without replacement (with it when the file has fewer) from a dataset file's pairs
    that fit: both lengths at least 1, input + output <= max_len."""
    pairs = [(i, o) for i, o in READERS[name](path, encode) if i >= 1 and o >= 1 and i + o <= max_len]
    if not pairs:
        raise ValueError(f"{path}: no request of at least one token each way fits in {max_len} tokens")
    idx = np.random.default_rng(seed).choice(len(pairs), size=n, replace=n > len(pairs))
    return Workload(name, str(path), tuple(pairs[k][0] for k in idx), tuple(pairs[k][1] for k in idx))


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (seconds from 0) of `n` requests of a Poisson process at `rate` requests/s; an infinite
    rate sends them all at 0."""
    if math.isinf(rate):
        return np.zeros(n)
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    return np.cumsum(rng.exponential(1.0 / rate, size=n))
