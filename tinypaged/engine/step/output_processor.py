"""The output side of every request, in one place: each sequence's state (text by incremental detokenization,
logprobs, cumulative logprob, stop reason), stop checks, prompt logprobs, and the RequestOutput snapshots."""

from __future__ import annotations

import time

import torch

from tinypaged.core.sequence import Sequence, SequenceStatus
from tinypaged.engine.request import (
    Extend,
    Request,
    SeqState,
    TokenSample,
    end_text,
    sync_text,
)
from tinypaged.engine.sampling.sampler import seq_seed
from tinypaged.engine.sampling.structured import first_line
from tinypaged.outputs import Logprob, RequestMetrics, RequestOutput
from tinypaged.sampling_params import RequestOutputKind, SamplingParams
from tinypaged.tokenizer import IncrementalDetokenizer, Tokenizer


def check_stop(
    params: SamplingParams,
    seq: Sequence,
    state: SeqState,
    token: int,
    eos_ids: frozenset[int],
    max_model_len: int,
) -> SequenceStatus | None:
    """Return the finished status the new token (appended to `seq`) gives the sequence, or None to go on.

    The token is detokenized now where its text is needed now: for stop strings, or for a snapshot after
    each step (see `sync_text`). Stop strings are searched only where a new match can be: from the stop
    string's length before the new text, so a stop string spanning several tokens is found once its last
    piece arrives.
    """
    before = len(state.text)
    if params.stop or params.output_kind is not RequestOutputKind.FINAL_ONLY:
        sync_text(seq, state)
    n_out = len(seq.token_ids) - seq.prompt_len
    if n_out >= params.min_tokens:
        if token in params.stop_token_ids:
            state.stop_reason = token
            return end_text(seq, state, SequenceStatus.FINISHED_STOPPED)
        if not params.ignore_eos and token in eos_ids:
            return end_text(seq, state, SequenceStatus.FINISHED_STOPPED)
        best = None
        for stop in params.stop:
            at = state.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            state.text = (
                state.text[: at + len(stop)] if params.include_stop_str_in_output else state.text[:at]
            )
            state.stop_reason = stop
            return SequenceStatus.FINISHED_STOPPED
    if params.max_tokens is not None and n_out >= params.max_tokens:
        return end_text(seq, state, SequenceStatus.FINISHED_LENGTH)
    if len(seq.token_ids) >= max_model_len:
        return end_text(seq, state, SequenceStatus.FINISHED_LENGTH)
    return None


def metrics_of(req: Request, finished: bool) -> RequestMetrics:
    """A copy of the request's metrics for an output, its end stamped now if it just finished (whichever way:
    its last token, an abort, a fault, a refusal)."""
    if finished and req.metrics.finished_time is None:
        req.metrics.finished_time = time.monotonic()
    return req.metrics.copy()


class GrammarError(RuntimeError):
    """A token its matcher refused: never one the mask forbade (it was masked), but consuming it can run out
    one of llguidance's limits. The request fails alone, with the reason."""


def prompt_logprob_entries(
    tokenizer: Tokenizer, logits: torch.Tensor, prompt_ids: list[int], first: int, have: int, k: int
) -> list[dict[int, Logprob]]:
    """Prompt logprob entries from a chunk's logits (positions from `first`); `have` entries are known.

    Position p predicts prompt token p + 1; a chunk recomputed after preemption adds nothing twice.
    """
    r0 = max(0, have - 1 - first)
    r1 = min(logits.shape[0], len(prompt_ids) - 1 - first)
    if r1 <= r0:
        return []
    logp = torch.log_softmax(logits[r0:r1].float(), dim=-1)
    targets = torch.tensor(prompt_ids[first + r0 + 1 : first + r1 + 1], device=logp.device)
    chosen = logp.gather(1, targets[:, None])
    ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()
    top = logp.topk(k, dim=-1) if k else None
    top_ids = top.indices.tolist() if top is not None else [[] for _ in ranks]
    top_lps = top.values.tolist() if top is not None else [[] for _ in ranks]
    entries = []
    for t, lp, rank, ids, lps in zip(
        targets.tolist(), chosen[:, 0].tolist(), ranks, top_ids, top_lps, strict=True
    ):
        alternatives = enumerate(zip(ids, lps, strict=True))
        entry = {i: Logprob(v, r + 1, tokenizer.decode([i], False)) for r, (i, v) in alternatives}
        entry.setdefault(t, Logprob(lp, rank, tokenizer.decode([t], False)))
        entries.append(entry)
    return entries


class OutputProcessor:
    """Turns tokens into what a client sees: a new sequence's state, each appended token's logprobs, text and
    stop check, the prompt's logprobs, and a request's RequestOutput snapshot."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len

    def start(self, req: Request) -> None:
        """The state of a new request's first sequence (output 0), and its prompt logprobs if asked for."""
        p = req.params
        seq = req.group.seqs[0]
        # Beams are decoded whole when reported: which of them survive is known only then.
        detok = (
            None
            if p.use_beam_search
            else IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, p.skip_special_tokens)
        )
        seed_key = seq_seed(p.seed, 0) if p.seed is not None else None
        req.states[seq.seq_id] = SeqState(0, detok, seed_key, logprobs=[] if p.logprobs is not None else None)
        if p.prompt_logprobs is not None:
            req.prompt_logprobs = [None]

    def fork(self, req: Request, parent: Sequence, child: Sequence, index: int) -> None:
        """The state of a forked sequence: its parent's so far, under its own index and random stream."""
        p = req.params
        seed_key = seq_seed(p.seed, index) if p.seed is not None else None
        req.states[child.seq_id] = req.states[parent.seq_id].fork(index, seed_key)

    def append(self, req: Request, seq: Sequence, ext: Extend) -> SequenceStatus | None:
        """Account for a token just appended to `seq`: its logprobs, its text; the finished status it gives
        the sequence, or None to go on."""
        state, sample = req.states[seq.seq_id], ext.sample
        if ext.cumulative_logprob is not None:
            state.cumulative_logprob = ext.cumulative_logprob
        elif sample.logprob is not None:
            state.cumulative_logprob += sample.logprob
        if state.logprobs is not None:
            state.logprobs.append(self.logprob_entry(req.params, sample))
        status = check_stop(req.params, seq, state, sample.token, self.eos_ids, self.max_model_len)
        matcher = state.matcher
        if matcher is not None:
            if not matcher.consume_token(sample.token):
                raise GrammarError(first_line(matcher))
            # A complete grammar ends the output ("stop", even at max_tokens). Not a beam: it becomes a
            # hypothesis by its stop token, which is then all the grammar allows.
            if matcher.is_stopped() and not req.params.use_beam_search:
                status = (
                    status if status is not None else end_text(seq, state, SequenceStatus.FINISHED_STOPPED)
                )
                status = SequenceStatus.FINISHED_STOPPED
        return status

    def logprob_entry(self, params: SamplingParams, sample: TokenSample) -> dict[int, Logprob]:
        """The token's Logprob and its top `params.logprobs` alternatives, by token id."""
        assert sample.logprob is not None and sample.rank is not None
        decode = self.tokenizer.decode
        top = sample.top[: params.logprobs or 0] if sample.top else []
        entry = {t: Logprob(lp, rank + 1, decode([t], False)) for rank, (t, lp) in enumerate(top)}
        entry.setdefault(sample.token, Logprob(sample.logprob, sample.rank, decode([sample.token], False)))
        return entry

    def wants_prompt_logits(self, req: Request, seq_id: int) -> bool:
        """Whether a chunk of this sequence's prompt should come with its logits (prompt_logprobs)."""
        first = req.group.seqs[0]
        return (
            req.prompt_logprobs is not None
            and first.seq_id == seq_id
            and len(req.prompt_logprobs) < first.prompt_len
        )

    def add_prompt_logprobs(self, req: Request, logits: torch.Tensor, first: int) -> None:
        """Score the prompt tokens a chunk's logits predict (the chunk starts at position `first`)."""
        assert req.prompt_logprobs is not None
        req.prompt_logprobs += prompt_logprob_entries(
            self.tokenizer,
            logits,
            req.prompt_token_ids,
            first,
            len(req.prompt_logprobs),
            req.params.prompt_logprobs or 0,
        )

    def output(self, req: Request) -> RequestOutput:
        """The request as it stands, as vLLM's RequestOutput (output lists and metrics copied: the state keeps
        growing; the prompt's ids are one list for the request's life)."""
        group = req.group
        finished = group.is_finished()
        return RequestOutput(
            request_id=group.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=req.strategy.outputs(req),
            finished=finished,
            error=req.error,
            error_kind=req.error_kind,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            metrics=metrics_of(req, finished),
        )

    def failed(self, req: Request) -> RequestOutput:
        """The final output of a request the engine ended on a fault: no outputs (its state may be the
        fault's), only why."""
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[],
            finished=True,
            error=req.error,
            error_kind=req.error_kind,
            metrics=metrics_of(req, True),
        )
