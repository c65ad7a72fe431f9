"""Per-sequence output state: streaming detokenization, stop checks, and the text a client may see so far."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from tinypaged.core.sequence import Sequence, SequenceStatus
from tinypaged.engine.sampler import SamplerOutput
from tinypaged.outputs import CompletionOutput, Logprob
from tinypaged.sampling_params import SamplingParams
from tinypaged.tokenizer import IncrementalDetokenizer, Tokenizer

FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
}


@dataclass
class SeqState:
    """What the core does not keep about one sequence: its text, logprobs, random stream, why it stopped."""

    index: int  # its position among the request's sequences
    detok: IncrementalDetokenizer | None  # None under beam search: beams are decoded whole when reported
    seed_key: int | None = None
    text: str = ""  # everything detokenized so far (cut at the stop string once one is found)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None

    def fork(self, index: int, seed_key: int | None) -> SeqState:
        """A copy for a forked sequence (beam search): same text and logprobs so far."""
        child = copy.copy(self)
        child.index, child.seed_key = index, seed_key
        child.detok = copy.deepcopy(self.detok) if self.detok is not None else None
        child.logprobs = list(self.logprobs) if self.logprobs is not None else None
        return child


def check_stop(
    params: SamplingParams,
    seq: Sequence,
    state: SeqState,
    token: int,
    eos_ids: frozenset[int],
    max_model_len: int,
) -> SequenceStatus | None:
    """Detokenize the new token and return the finished status it gives the sequence, or None to go on.

    Stop strings are searched only where a new match can be: from the stop string's length before the new
    text, so a stop string spanning several tokens is found once its last piece arrives.
    """
    before = len(state.text)
    if state.detok is not None:
        state.text += state.detok.step([token])
    n_out = len(seq.token_ids) - seq.prompt_len
    if n_out >= params.min_tokens:
        if token in params.stop_token_ids:
            state.stop_reason = token
            return _end(state, SequenceStatus.FINISHED_STOPPED)
        if not params.ignore_eos and token in eos_ids:
            return _end(state, SequenceStatus.FINISHED_STOPPED)
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
        return _end(state, SequenceStatus.FINISHED_LENGTH)
    if len(seq.token_ids) >= max_model_len:
        return _end(state, SequenceStatus.FINISHED_LENGTH)
    return None


def _end(state: SeqState, status: SequenceStatus) -> SequenceStatus:
    if state.detok is not None:
        state.text += state.detok.flush()  # a dangling partial character, if any
    return status


def visible_text(params: SamplingParams, state: SeqState, finished: bool) -> str:
    """The text a stream may show: while running, a tail that could still begin a stop string is held back."""
    text = state.text
    if finished or not params.stop:
        return text
    hold = 0
    for stop in params.stop:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return text[: len(text) - hold] if hold else text


def completion(
    params: SamplingParams, seq: Sequence, state: SeqState, index: int, text: str | None = None
) -> CompletionOutput:
    """A snapshot of one sequence as vLLM's CompletionOutput (lists copied: the state keeps growing)."""
    finished = seq.status.is_finished
    return CompletionOutput(
        index=index,
        text=visible_text(params, state, finished) if text is None else text,
        token_ids=seq.token_ids[seq.prompt_len :],
        cumulative_logprob=state.cumulative_logprob if params.logprobs is not None else None,
        logprobs=list(state.logprobs) if state.logprobs is not None else None,
        finish_reason=FINISH_REASON.get(seq.status),
        stop_reason=state.stop_reason,
    )


def logprob_entry(
    tokenizer: Tokenizer, params: SamplingParams, row: int, result: SamplerOutput
) -> dict[int, Logprob]:
    """The sampled token's Logprob and the top `params.logprobs` alternatives of one sampler row."""
    assert result.logprobs is not None and result.top_ids is not None and result.top_logprobs is not None
    assert result.ranks is not None
    k = params.logprobs or 0
    top = zip(result.top_ids[row][:k], result.top_logprobs[row][:k], strict=True)
    entry = {t: Logprob(lp, rank + 1, tokenizer.decode([t], False)) for rank, (t, lp) in enumerate(top)}
    token = result.token_ids[row]
    entry.setdefault(
        token, Logprob(result.logprobs[row], result.ranks[row], tokenizer.decode([token], False))
    )
    return entry


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
