"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeds and logprobs in one pass on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinypaged.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs about one row of logits."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None  # the request's own stream when it has a seed
    banned_ids: tuple[int, ...] = ()  # e.g. EOS while fewer than min_tokens have been generated


@dataclass(frozen=True)
class SamplerOutput:
    """Sampled token per row, with its logprob and the top-k alternatives when asked for."""

    token_ids: list[int]
    logprobs: list[float] | None  # the sampled token's logprob per row
    top_ids: list[list[int]] | None  # [N][k] per row (k = the batch's largest logprobs request)
    top_logprobs: list[list[float]] | None
    ranks: list[int] | None  # rank of the sampled token in the distribution (1 = most likely)


class Sampler:
    """Turns the logits of the rows being sampled into next tokens."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        raw = logits
        logits = logits.clone()
        device = logits.device
        n, vocab = logits.shape
        params = [r.params for r in rows]
        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
            logits = self._apply_penalties(logits, rows)
        for i, r in enumerate(rows):
            if r.banned_ids:
                logits[i, list(r.banned_ids)] = float("-inf")

        greedy = torch.tensor([p.greedy for p in params], device=device)
        next_ids = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
            probs = torch.softmax(logits / temps[:, None], dim=-1)
            probs = self._filter(probs, params)
            # Exponential race: argmax(p / q) with q ~ Exp(1) draws from p; a seeded row draws its own noise.
            q = torch.empty_like(probs).exponential_()
            for i, r in enumerate(rows):
                if r.generator is not None and not r.params.greedy:
                    q[i] = torch.empty(vocab, device=device).exponential_(generator=r.generator)
            sampled = (probs / q).argmax(dim=-1)
            next_ids = torch.where(greedy, next_ids, sampled)

        k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if k is None:
            return SamplerOutput(next_ids.tolist(), None, None, None, None)
        logp = torch.log_softmax(raw.float(), dim=-1)
        chosen = logp.gather(1, next_ids[:, None])
        ranks = (logp > chosen).sum(dim=-1) + 1
        top = logp.topk(k, dim=-1) if k > 0 else None
        return SamplerOutput(
            next_ids.tolist(),
            chosen[:, 0].tolist(),
            top.indices.tolist() if top is not None else [[] for _ in range(n)],
            top.values.tolist() if top is not None else [[] for _ in range(n)],
            ranks.tolist(),
        )

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """vLLM's penalties: repetition over prompt and output tokens, presence and frequency over outputs."""
        device = logits.device
        n, vocab = logits.shape

        def counts(seqs: list[list[int]]) -> torch.Tensor:
            width = max((len(s) for s in seqs), default=0)
            out = torch.zeros(n, vocab + 1, device=device)
            if width:
                ids = torch.tensor([s + [vocab] * (width - len(s)) for s in seqs], device=device)
                out.scatter_add_(1, ids, torch.ones_like(ids, dtype=out.dtype))
            return out[:, :vocab]  # column `vocab` collected the padding

        out_counts = counts([r.output_ids for r in rows])
        prompt_seen = counts([r.prompt_ids for r in rows]) > 0
        rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device)[:, None]
        seen = prompt_seen | (out_counts > 0)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[:, None]
        pres = torch.tensor([r.params.presence_penalty for r in rows], device=device)[:, None]
        return logits - freq * out_counts - pres * (out_counts > 0)

    @staticmethod
    def _filter(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Zero the probabilities that top-k, top-p and min-p rule out (rows keep at least their best token)."""
        device = probs.device
        vocab = probs.shape[-1]
        top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        if bool((top_k >= vocab).all() and (top_p >= 1.0).all() and (min_p <= 0.0).all()):
            return probs
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the strictly more likely tokens
        drop = (rank >= top_k[:, None]) | (before > top_p[:, None])
        drop |= sorted_p < min_p[:, None] * sorted_p[:, :1]
        drop[:, 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(1, order, sorted_p)
