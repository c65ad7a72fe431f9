"""Batched sampling: penalties, then temperature, top-k, top-p and min-p drawn without sorting (`ops.sample`, a
Triton kernel on the GPU), per-row keys for seeds, logprobs; nothing waits for the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinypaged import ops
from tinypaged.engine.request import TokenSample
from tinypaged.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment


def mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int: a well-spread 64-bit hash."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seq_seed(seed: int, index: int) -> int:
    """The stream key of sequence `index` of a request with this seed (n > 1: one stream per sequence)."""
    return mix64(mix64(seed) + index * _GAMMA)


@dataclass
class SamplingRow:
    """What the sampler needs about one row of logits."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    seed_key: int | None = None  # the sequence's own random stream (seq_seed) when the request has a seed
    banned_ids: tuple[int, ...] = ()  # e.g. EOS while fewer than min_tokens have been generated
    # Tokens generated so far, counting any still pending on the device (async scheduling); None: the length
    # of output_ids (which the engine fills only when penalties need it).
    num_outputs: int | None = None

    @property
    def generated(self) -> int:
        """How many tokens the sequence has generated before this draw."""
        return len(self.output_ids) if self.num_outputs is None else self.num_outputs


@dataclass(frozen=True)
class SamplerOutput:
    """Sampled token per row, with its logprob and the top-k alternatives when asked for."""

    token_ids: list[int]
    logprobs: list[float] | None  # the sampled token's logprob per row (the model's raw distribution)
    top_ids: list[list[int]] | None  # [N][k] per row (k = the batch's largest logprobs request)
    top_logprobs: list[list[float]] | None
    ranks: list[int] | None  # rank of the sampled token in the distribution (1 = most likely)
    # Per row: whether the processed distribution was usable (a finite best logit). False when every token was
    # banned or the logits held NaN or infinities: that row's token means nothing.
    valid: list[bool] | None = None

    def samples(self) -> list[TokenSample]:
        """One TokenSample per row."""
        if self.logprobs is None:
            return [TokenSample(t) for t in self.token_ids]
        assert self.ranks is not None and self.top_ids is not None and self.top_logprobs is not None
        return [
            TokenSample(t, lp, rank, list(zip(ids, lps, strict=True)) if ids else None)
            for t, lp, rank, ids, lps in zip(
                self.token_ids, self.logprobs, self.ranks, self.top_ids, self.top_logprobs, strict=True
            )
        ]


@dataclass(frozen=True)
class SampledBatch:
    """A sampling pass as launched: the token ids stay on the device (the next step can read them there)
    while they and any logprobs copy to the host; `result()` waits for the copy alone, not for later work."""

    token_ids: torch.Tensor  # [N] int64, on the logits' device
    # Host copies: ids, validity, then chosen logprobs, top ids, top logprobs, ranks (None when not asked).
    _host: tuple[torch.Tensor | None, ...]
    _copied: torch.cuda.Event | None  # recorded after the copies (None on the CPU: they are done)

    def result(self) -> SamplerOutput:
        """The sampled tokens (and logprobs) as Python lists."""
        if self._copied is not None:
            self._copied.synchronize()
        ids, valid, chosen, top_ids, top_lps, ranks = self._host
        assert ids is not None and valid is not None
        if chosen is None:
            return SamplerOutput(ids.tolist(), None, None, None, None, valid.tolist())
        n = len(ids)
        return SamplerOutput(
            ids.tolist(),
            chosen.tolist(),
            top_ids.tolist() if top_ids is not None else [[] for _ in range(n)],
            top_lps.tolist() if top_lps is not None else [[] for _ in range(n)],
            ranks.tolist() if ranks is not None else None,
            valid.tolist(),
        )


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without waiting: through pinned memory on a GPU (a pageable copy
    would synchronise with the work already queued)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class Sampler:
    """Turns the logits of the rows being sampled into next tokens.

    Nothing here waits for the device (top-p's data-dependent work stays in the kernel), so a step's sampling
    can be queued behind its forward pass.
    """

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], need_logprobs: bool = False
    ) -> SamplerOutput:
        """Sample one token per row; logprobs when any row asks for them (or need_logprobs)."""
        return self.sample(logits, rows, need_logprobs).result()

    def sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], need_logprobs: bool = False
    ) -> SampledBatch:
        """Queue the sampling of one token per row and the copy of its results to the host."""
        raw = logits
        logits = self.process(logits, rows)
        device = logits.device
        params = [r.params for r in rows]
        best = logits.argmax(dim=-1)
        # A row has a token to draw iff its largest logit is finite; the argmax points at it (a NaN included:
        # argmax takes NaN as the largest), so one gather replaces a second pass over the vocabulary.
        valid = torch.isfinite(logits.gather(1, best[:, None])[:, 0])
        next_ids = best
        if not all(p.greedy for p in params):
            vocab, n = logits.shape[-1], len(params)
            # One upload for the rows of parameters, each padded to a multiple of 4 entries so that every row
            # starts 16-byte aligned: Triton specialises a kernel on its pointers' alignment, and unpadded rows
            # would compile the sampling kernel three times over (row counts 0, 2 and 1 mod 4).
            pad = [0] * (-n % 4)
            floats = upload(
                [
                    [0.0 if p.greedy else p.temperature for p in params] + pad,
                    [p.top_p for p in params] + pad,
                    [p.min_p for p in params] + pad,
                ],
                torch.float32,
                device,
            )[:, :n]
            top_k = [p.top_k if p.top_k < vocab else 0 for p in params]
            ints = upload([top_k + pad, _keys(rows) + pad], torch.int64, device)[:, :n]
            sampled = ops.sample(logits, ops.SampleParams(floats[0], ints[0], floats[1], floats[2], ints[1]))
            if any(p.greedy for p in params):
                greedy = upload([p.greedy for p in params], torch.bool, device)
                next_ids = torch.where(greedy, best, sampled)
            else:
                next_ids = sampled

        k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        tensors: tuple[torch.Tensor | None, ...] = (next_ids, valid, None, None, None, None)
        if k is not None or need_logprobs:
            k = k or 0
            logp = torch.log_softmax(raw.float(), dim=-1)
            chosen = logp.gather(1, next_ids[:, None])
            ranks = (logp > chosen).sum(dim=-1) + 1
            top = logp.topk(k, dim=-1) if k > 0 else None
            tensors = (
                next_ids,
                valid,
                chosen[:, 0],
                top.indices if top is not None else None,
                top.values if top is not None else None,
                ranks,
            )
        if device.type != "cuda":
            return SampledBatch(next_ids, tensors, None)
        host = tuple(t.to("cpu", non_blocking=True) if t is not None else None for t in tensors)
        copied = torch.cuda.Event()
        copied.record()
        return SampledBatch(next_ids, host, copied)

    def process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The logits with penalties and banned tokens applied: a new float32 tensor, or `logits` itself when
        no row has either (never to be written to)."""
        pen = [i for i, r in enumerate(rows) if has_penalty(r.params)]
        if not pen and not any(r.banned_ids for r in rows):
            return logits
        logits = logits.float().clone()
        if pen:
            idx = upload(pen, torch.int64, logits.device)
            logits[idx] = self._apply_penalties(logits[idx], [rows[i] for i in pen])
        banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_ids]
        if banned:
            at = upload(banned, torch.int64, logits.device)
            logits[at[:, 0], at[:, 1]] = float("-inf")
        return logits

    def beam_logprobs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Log-softmax of the processed logits `[N, vocab]`, which beam search ranks continuations by."""
        return torch.log_softmax(self.process(logits, rows), dim=-1, dtype=torch.float32)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """vLLM's penalties: repetition over prompt and output tokens, presence and frequency over outputs."""
        device = logits.device
        n, vocab = logits.shape

        def counts(seqs: list[list[int]]) -> torch.Tensor:
            width = max((len(s) for s in seqs), default=0)
            out = torch.zeros(n, vocab + 1, device=device)
            if width:
                ids = upload([s + [vocab] * (width - len(s)) for s in seqs], torch.int64, device)
                out.scatter_add_(1, ids, torch.ones_like(ids, dtype=out.dtype))
            return out[:, :vocab]  # column `vocab` collected the padding

        out_counts = counts([r.output_ids for r in rows])
        prompt_seen = counts([r.prompt_ids for r in rows]) > 0
        rep = upload([r.params.repetition_penalty for r in rows], torch.float32, device)[:, None]
        seen = prompt_seen | (out_counts > 0)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        freq = upload([r.params.frequency_penalty for r in rows], torch.float32, device)[:, None]
        pres = upload([r.params.presence_penalty for r in rows], torch.float32, device)[:, None]
        return logits - freq * out_counts - pres * (out_counts > 0)


def has_penalty(p: SamplingParams) -> bool:
    """Whether the request's sampling depends on the tokens generated so far (beyond their number)."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _keys(rows: list[SamplingRow]) -> list[int]:
    """Each row's 62-bit sampling key: for a seeded row a hash of its stream key and how many tokens it has
    generated (so a request repeats exactly whatever else is in the batch, and the stream moves on with each
    token); torch's host RNG (seeded by the engine) for the others. No device work, no sync."""
    fresh = torch.randint(0, 1 << 62, (len(rows),)).tolist()
    return [
        fresh[i] if r.seed_key is None else mix64(r.seed_key + (r.generated + 1) * _GAMMA) >> 2
        for i, r in enumerate(rows)
    ]
