"""Sort-free sampling (semantics and algorithm: `ops.ref_sample`): one program per row, streaming the row's
logits in blocks; the row stays in L2 across its passes, and nothing comes back to the host.

Passes over a row: the max and the softmax sum (per lane, one reduction at the end); with top-k, its threshold
by radix select over the float's ordered bits (4 histogram passes); with top-k or min-p, the top-k and the
candidates' masses (one pass); then per rejection round an inverse-CDF search (block sums, then a scan of the
one block where the target falls) and, when top-p is on, the mass of the tokens more likely than the pick
(the next round's candidate mass). A round is accepted with probability >= top_p: top-p sampling usually costs
three passes, top-k with min-p seven.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _h32(x):
    """lowbias32 on uint32 (wrapping), as `ops._h32`."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _ordered(bits):
    """float32 bits (int32) <-> an int32 whose order is the float's (an involution)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _z(base, idx, vocab, inv_t):
    """A block of z = logits / temperature, -inf past the vocabulary."""
    return tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) * inv_t


@triton.jit
def _kth_largest(base, vocab, inv_t, k, BLOCK: tl.constexpr):
    """The k-th largest z of a row: radix select over the float's ordered bits, 8 bits a pass (4 passes)."""
    cols = tl.arange(0, BLOCK)
    prefix = tl.zeros((), tl.uint32)  # the ordered key's digits found so far
    rest = k  # how many of the largest are still to be passed, among the keys under `prefix`
    for level in tl.static_range(4):
        hist = tl.zeros((256,), tl.int32)
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            key = _ordered(_z(base, idx, vocab, inv_t).to(tl.int32, bitcast=True)).to(tl.uint32, bitcast=True)
            key = key ^ 0x80000000  # unsigned order = float order
            if level == 0:
                match = idx < vocab
            else:
                match = (idx < vocab) & ((key >> (32 - 8 * level)) == (prefix >> (32 - 8 * level)))
            hist += tl.histogram(((key >> (24 - 8 * level)) & 0xFF).to(tl.int32), 256, mask=match)
        # at_least[d]: keys under the prefix whose digit is >= d; the k-th largest has the last digit where
        # that still reaches `rest`.
        at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
        digit = tl.sum((at_least >= rest).to(tl.int32), 0) - 1
        digits = tl.arange(0, 256)
        above = tl.sum(tl.where(digits == digit, at_least - hist, 0), 0)
        rest = rest - above
        prefix = prefix | (digit.to(tl.uint32) << (24 - 8 * level))
    return _ordered((prefix ^ 0x80000000).to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride,
    vocab,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    keys_ptr,
    out_ptr,
    MAX_ROUNDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(temp_ptr + row)
    if temp > 0:
        base = logits_ptr + row * stride
        inv_t = 1.0 / temp
        cols = tl.arange(0, BLOCK)
        neg_inf = float("-inf")

        # The max of z and sum(exp(z - max)), online per lane (one cross-lane reduction at the end).
        m_lane = tl.full((BLOCK,), neg_inf, tl.float32)
        s_lane = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, vocab, BLOCK):
            z = _z(base, start + cols, vocab, inv_t)
            new_m = tl.maximum(m_lane, z)
            keep = tl.where(new_m == neg_inf, 0.0, tl.exp(m_lane - new_m))
            s_lane = s_lane * keep + tl.where(z == neg_inf, 0.0, tl.exp(z - new_m))
            m_lane = new_m
        m = tl.max(m_lane, 0)
        total = tl.sum(tl.where(m_lane == neg_inf, 0.0, s_lane * tl.exp(m_lane - m)), 0)

        k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        tau_k = tl.full((), neg_inf, tl.float32)
        if (k > 0) & (k < vocab):
            tau_k = _kth_largest(base, vocab, inv_t, k, BLOCK)
        floor = tl.maximum(tl.where(min_p > 0, m + tl.log(tl.maximum(min_p, 1e-30)), neg_inf), tau_k)
        # The top-k mass (top-p's denominator) and the candidates' mass (the first draw's), in one pass.
        mass_k = total
        mass = total
        if floor > neg_inf:
            acc_k = tl.zeros((BLOCK,), tl.float32)
            acc = tl.zeros((BLOCK,), tl.float32)
            for start in range(0, vocab, BLOCK):
                z = _z(base, start + cols, vocab, inv_t)
                e = tl.exp(z - m)
                acc_k += tl.where(z >= tau_k, e, 0.0)
                acc += tl.where(z >= floor, e, 0.0)
            mass_k = tl.sum(acc_k, 0)
            mass = tl.sum(acc, 0)

        key = tl.load(keys_ptr + row)
        key_lo = (key & 0xFFFFFFFF).to(tl.uint32)
        key_hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
        # Rejection rounds: an inverse-CDF draw among the candidates (>= floor and > pivot), accepted when the
        # tokens more likely than the pick hold less than top_p of the top-k mass, else the pivot rises to it.
        best = tl.zeros((), tl.int64)
        pivot = tl.full((), neg_inf, tl.float32)
        rnd = tl.zeros((), tl.uint32)
        done = tl.zeros((), tl.int32)
        while done == 0:
            h = _h32(key_lo ^ _h32(key_hi + rnd * 0x9E3779B9))
            target = (
                ((h >> 8).to(tl.float32) + 0.5) * 5.960464477539063e-08 * mass
            )  # U(0, 1) (24 bits) x mass
            # The block where the running mass reaches the target (block sums only), then a scan of that block.
            running = tl.zeros((), tl.float32)
            hit_start = tl.zeros((), tl.int32) - 1
            hit_before = tl.zeros((), tl.float32)
            last_start = tl.zeros((), tl.int32)
            for start in range(0, vocab, BLOCK):
                z = _z(base, start + cols, vocab, inv_t)
                block = tl.sum(tl.where((z >= floor) & (z > pivot), tl.exp(z - m), 0.0), 0)
                first = (hit_start < 0) & (running + block >= target) & (block > 0)
                hit_before = tl.where(first, running, hit_before)
                hit_start = tl.where(first, start, hit_start)
                last_start = tl.where(block > 0, start, last_start)
                running += block
            # Past the end only by rounding: the last block that has a candidate, and its last candidate.
            at = tl.where(hit_start >= 0, hit_start, last_start)
            before = tl.where(hit_start >= 0, hit_before, target)
            idx = at + cols
            z = _z(base, idx, vocab, inv_t)
            w = tl.where((z >= floor) & (z > pivot), tl.exp(z - m), 0.0)
            below = (tl.cumsum(w, 0) + before < target) | (w <= 0)
            last_cand = tl.max(tl.where(w > 0, idx, 0), 0)
            first_cand = tl.min(tl.where(below, vocab, idx), 0)
            pick = tl.minimum(first_cand, last_cand).to(tl.int64)
            found = mass > 0
            accept = (mass <= 0) | (top_p >= 1.0) | (rnd == MAX_ROUNDS - 1)
            z_pick = tl.load(base + pick).to(tl.float32) * inv_t
            if accept == 0:
                acc = tl.zeros((BLOCK,), tl.float32)
                for start in range(0, vocab, BLOCK):
                    z = _z(base, start + cols, vocab, inv_t)
                    acc += tl.where(z > z_pick, tl.exp(z - m), 0.0)
                above = tl.sum(acc, 0)
                accept = above < top_p * mass_k
                mass = above  # the next round's candidates: the tokens more likely than the pick
            if found:
                best = pick
            pivot = z_pick
            rnd += 1
            done = accept.to(tl.int32)
        tl.store(out_ptr + row, best)


def sample(logits: torch.Tensor, params: tuple[torch.Tensor, ...], max_rounds: int) -> torch.Tensor:
    """One token per row (semantics: `ops.ref_sample`, `params` its `SampleParams`); rows with temperature 0
    get 0."""
    temperature, top_k, top_p, min_p, keys = params
    n, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.zeros(n, dtype=torch.int64, device=logits.device)
    if n:
        _sample_kernel[(n,)](
            logits,
            logits.stride(0),
            vocab,
            temperature.float().contiguous(),
            top_k.to(torch.int32).contiguous(),
            top_p.float().contiguous(),
            min_p.float().contiguous(),
            keys.to(torch.int64).contiguous(),
            out,
            MAX_ROUNDS=max_rounds,
            BLOCK=min(_BLOCK, triton.next_power_of_2(vocab)),
            num_warps=8,
        )
    return out
