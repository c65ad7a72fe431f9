"""Speculative decoding's verification: the target's k + 1 logits rows of a sequence against its k proposed
tokens, by rejection sampling (Leviathan et al. 2023; Chen et al. 2023), so that the tokens emitted are
distributed exactly as the target's own sampling would draw them, one at a time.

Row j of a sequence is the target's distribution at the position after proposed tokens 1..j, processed as the
sampler processes a row (penalties over the output as if those j tokens were accepted, min_tokens' bans, then
temperature, top-k, top-p and min-p: `target_probs`, the distribution `ops.sample` draws from). Proposed token
j + 1 is accepted with probability min(1, p(d) / q(d)), q the draft's distribution at that position (a point
mass for a deterministic proposer such as n-gram lookup: accept with probability p(d)); the first rejection
draws its replacement from the normalised residual max(0, p - q) and ends the run; if every proposal is
accepted, a bonus token is drawn from the last row. Greedy rows are point masses at the argmax, so greedy
verification accepts exactly the proposals that equal the target's argmax and replaces the first that does not
with it. Logprobs are the target's raw distribution's, as the sampler reports them.

Random draws are a function of the sequence's seed and the output position (as the sampler's keys), so a seeded
request repeats exactly; unseeded rows take torch's host generator, which the engine seeds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinypaged.engine.request import TokenSample
from tinypaged.engine.sampling.sampler import _GAMMA, Sampler, SamplingRow, mix64, upload

_ACCEPT, _RESAMPLE = 0x5EC0A11CE, 0x2E5A3B1E  # salts: the two uniforms of one position are independent
_TINY = 2.0**-24


@dataclass(frozen=True)
class Verify:
    """One sequence's verification: rows[j] samples position j (k + 1 rows for k proposed tokens); q is the
    draft's distribution at each proposed position `[k, vocab]` (None: a point mass on each proposal); `accept`
    (benchmarks: the oracle proposer) overrides how many proposals are accepted."""

    rows: list[SamplingRow]
    proposed: tuple[int, ...]
    q: torch.Tensor | None = None
    accept: int | None = None


@dataclass(frozen=True)
class Verified:
    """What verification emits for one sequence: the accepted proposals then one drawn token (each with the
    target's logprobs when asked for), and whether every row's distribution was usable."""

    samples: list[TokenSample]
    valid: bool

    @property
    def num_accepted(self) -> int:
        """Proposed tokens accepted."""
        return len(self.samples) - 1


def target_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each row's next token is drawn from `[N, vocab]` (float32), from processed logits:
    greedy rows a point mass at the argmax; the others softmax(logits / temperature) restricted as `ref_sample`
    restricts it: to the top-k (ties at the threshold kept) and above min-p, then to the nucleus: the tokens
    whose strictly more likely tokens hold less than top-p of the top-k's mass."""
    n, vocab = logits.shape
    dev = logits.device
    params = [r.params for r in rows]
    best = logits.argmax(dim=-1)
    probs = torch.zeros(n, vocab, dtype=torch.float32, device=dev)
    probs[torch.arange(n, device=dev), best] = 1.0
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return probs
    idx = upload(sampled, torch.int64, dev)
    t = upload([params[i].temperature for i in sampled], torch.float32, dev)
    z = logits[idx].float() * (1.0 / t)[:, None]
    m = z.amax(dim=-1, keepdim=True)
    e = torch.where(z == float("-inf"), 0.0, torch.exp(z - m))
    inf = torch.full_like(m[:, 0], float("-inf"))
    k = torch.tensor([params[i].top_k if 0 < params[i].top_k < vocab else 0 for i in sampled], device=dev)
    tau_k = inf
    if bool((k > 0).any()):
        top = z.topk(int(k.max()), dim=-1).values
        tau_k = torch.where(k > 0, top.gather(1, (k.clamp(min=1) - 1)[:, None])[:, 0], inf)
    mp = upload([params[i].min_p for i in sampled], torch.float32, dev)
    floor = torch.maximum(torch.where(mp > 0, m[:, 0] + torch.log(mp.clamp(min=1e-30)), inf), tau_k)
    keep = z >= floor[:, None]
    top_p = upload([params[i].top_p for i in sampled], torch.float32, dev)
    if bool((top_p < 1.0).any()):
        mass_k = (e * (z >= tau_k[:, None])).sum(dim=-1)
        zs, order = z.sort(dim=-1, descending=True)
        es = e.gather(1, order)
        before = es.cumsum(dim=-1) - es  # mass strictly before each sorted position
        # Ties: a token's "more likely" mass is that before the first of its equals.
        first = torch.searchsorted(-zs.contiguous(), -zs.contiguous(), side="left")
        above = torch.empty_like(before).scatter_(1, order, before.gather(1, first))
        keep &= (above < (top_p * mass_k)[:, None]) | (top_p >= 1.0)[:, None]
    w = e * keep
    probs[idx] = w / w.sum(dim=-1, keepdim=True).clamp(min=1e-30)
    return probs


def _uniform(x: int) -> float:
    """A 64-bit hash as U(0, 1), kept clear of 0 and 1 in float32."""
    return min(max(((x >> 11) + 0.5) * 2.0**-53, _TINY), 1.0 - _TINY)


def _uniforms(rows: list[SamplingRow]) -> tuple[list[float], list[float]]:
    """Per row: the uniform its proposal's acceptance tests, and the one its replacement draw inverts."""
    fresh = torch.rand(2 * len(rows), dtype=torch.float64).tolist()
    acc, res = [], []
    for i, r in enumerate(rows):
        if r.seed_key is None:
            acc.append(min(max(fresh[2 * i], _TINY), 1.0 - _TINY))
            res.append(min(max(fresh[2 * i + 1], _TINY), 1.0 - _TINY))
        else:
            key = mix64(r.seed_key + (r.generated + 1) * _GAMMA)
            acc.append(_uniform(mix64(key ^ _ACCEPT)))
            res.append(_uniform(mix64(key ^ _RESAMPLE)))
    return acc, res


def verify(sampler: Sampler, logits: torch.Tensor, items: list[Verify]) -> list[Verified]:
    """Verify each sequence's proposals against its rows of `logits` (sequence after sequence, k + 1 rows
    each, in `items`' order); waits for the device (the host needs the accepted tokens to propose again)."""
    rows = [r for it in items for r in it.rows]
    raw = logits
    z = sampler.process(logits, rows)
    starts = [0]
    for it in items:
        starts.append(starts[-1] + len(it.rows))
    if all(r.params.greedy for r in rows):
        tokens, valid_rows = _greedy(z, items, starts)
    else:
        tokens, valid_rows = _rejection(z, items, rows, starts)
    samples = _with_logprobs(raw, starts, tokens, [it.rows[0] for it in items])
    return [Verified(s, all(valid_rows[starts[i] : starts[i] + len(s)])) for i, s in enumerate(samples)]


def _greedy(z: torch.Tensor, items: list[Verify], starts: list[int]) -> tuple[list[list[int]], list[bool]]:
    """Every row greedy: each row's distribution is a point mass at its argmax, so a proposal is accepted
    exactly when it is its row's argmax (p(d) is 1 or 0, whatever q(d)), and the token after the accepted run is
    that row's argmax (the residual max(0, p - q) of a point mass is the point mass, or empty, and then the row's
    own distribution): what the rejection path draws, from one reduction and one copy to the host."""
    top, best = z.max(dim=-1)  # the first of equal maxima, as argmax
    best_l, finite = torch.stack([best, torch.isfinite(top).to(best.dtype)]).tolist()
    tokens = []
    for it, start in zip(items, starts[:-1], strict=True):
        if it.accept is not None:  # the oracle's count (benchmarks)
            a = min(it.accept, len(it.proposed))
        else:
            a = 0
            while a < len(it.proposed) and it.proposed[a] == best_l[start + a]:
                a += 1
        tokens.append([*it.proposed[:a], best_l[start + a]])
    return tokens, [bool(f) for f in finite]


def _rejection(
    z: torch.Tensor, items: list[Verify], rows: list[SamplingRow], starts: list[int]
) -> tuple[list[list[int]], list[bool]]:
    """The emitted tokens of each sequence by rejection sampling (the module docstring), and whether each
    row's distribution was usable."""
    dev = z.device
    valid_rows = torch.isfinite(z.amax(dim=-1)).tolist()
    probs = target_probs(z, rows)
    u_acc, u_res = _uniforms(rows)
    # p(d) (and q(d)) of every proposal, to the host in one copy.
    at = [(starts[i] + j, d) for i, it in enumerate(items) for j, d in enumerate(it.proposed)]
    p_d: list[float] = []
    if at:
        pos = upload(at, torch.int64, dev)
        p_d = probs[pos[:, 0], pos[:, 1]].double().tolist()
    q_d: list[float] = []
    for it in items:
        if it.q is None:
            q_d += [1.0] * len(it.proposed)
        else:
            cols = torch.tensor(it.proposed, dtype=torch.int64, device=it.q.device)
            q_d += it.q[torch.arange(len(it.proposed), device=it.q.device), cols].double().tolist()
    accepted: list[int] = []
    n = 0
    for i, it in enumerate(items):
        if it.accept is not None:  # the oracle's count (benchmarks)
            a = min(it.accept, len(it.proposed))
        else:
            a = 0
            while a < len(it.proposed) and u_acc[starts[i] + a] * q_d[n + a] < p_d[n + a]:
                a += 1
        accepted.append(a)
        n += len(it.proposed)
    # The final token of each sequence: from the residual at its first rejection, else from its last row.
    final_rows = [starts[i] + a for i, a in enumerate(accepted)]
    dist = probs[upload(final_rows, torch.int64, dev)]
    for i, (it, a) in enumerate(zip(items, accepted, strict=True)):
        if a < len(it.proposed):
            if it.q is None:
                dist[i, it.proposed[a]] = 0.0
            else:
                dist[i] = (dist[i] - it.q[a].to(dist.device, torch.float32)).clamp(min=0.0)
    total = dist.sum(dim=-1, keepdim=True)
    # Rounding can empty a residual whose true mass is tiny: then the row's own distribution.
    dist = torch.where(total > 0, dist, probs[upload(final_rows, torch.int64, dev)])
    cdf = dist.cumsum(dim=-1)
    u = upload([u_res[r] for r in final_rows], torch.float32, dev)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    drawn = drawn.clamp(max=cdf.shape[-1] - 1).tolist()
    tokens = [list(it.proposed[:a]) + [t] for it, a, t in zip(items, accepted, drawn, strict=True)]
    return tokens, valid_rows


def _with_logprobs(
    raw: torch.Tensor, starts: list[int], tokens: list[list[int]], first: list[SamplingRow]
) -> list[list[TokenSample]]:
    """TokenSamples of the emitted tokens, with the target's raw logprobs, rank and top alternatives for the
    sequences that ask for logprobs (or rank samples by them: best_of)."""
    want = [i for i, r in enumerate(first) if r.params.logprobs is not None or r.params.num_seqs > r.params.n]
    out = [[TokenSample(t) for t in toks] for toks in tokens]
    if not want:
        return out
    at = [(starts[i] + j, t) for i in want for j, t in enumerate(tokens[i])]
    pos = upload(at, torch.int64, raw.device)
    logp = torch.log_softmax(raw[pos[:, 0]].float(), dim=-1)
    chosen = logp.gather(1, pos[:, 1:])
    ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()
    k = max(first[i].params.logprobs or 0 for i in want)
    top = logp.topk(k, dim=-1) if k else None
    top_ids = top.indices.tolist() if top is not None else None
    top_lps = top.values.tolist() if top is not None else None
    chosen_l = chosen[:, 0].tolist()
    n = 0
    for i in want:
        samples = []
        for t in tokens[i]:
            alts = list(zip(top_ids[n], top_lps[n], strict=True)) if top_ids and top_lps else None
            samples.append(TokenSample(t, chosen_l[n], ranks[n], alts))
            n += 1
        out[i] = samples
    return out
