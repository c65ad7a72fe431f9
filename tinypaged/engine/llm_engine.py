"""LLMEngine: requests in, one scheduler step + forward pass + sampling per `step()`, RequestOutputs out."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from tinypaged.config import EngineConfig
from tinypaged.core.kv_cache_manager import KVCacheManager
from tinypaged.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tinypaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from tinypaged.engine.model_runner import ModelRunner
from tinypaged.engine.sampler import Sampler, SamplerOutput, SamplingRow
from tinypaged.outputs import CompletionOutput, Logprob, RequestOutput
from tinypaged.sampling_params import SamplingParams
from tinypaged.tokenizer import IncrementalDetokenizer, Tokenizer

Prompt = str | dict[str, list[int]]

_FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
}


@dataclass
class _SeqState:
    """Per-sequence output state the core does not keep: text, logprobs, why it stopped."""

    detok: IncrementalDetokenizer
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None


@dataclass
class _Request:
    """One request: its group, parameters and the state of its sequences."""

    group: SequenceGroup
    prompt: str | None
    params: SamplingParams
    generator: torch.Generator | None
    states: dict[int, _SeqState] = field(default_factory=dict)
    error: str | None = None


class LLMEngine:
    """The synchronous engine: `add_request`, then `step()` until `has_unfinished_requests()` is False."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer(config.model.path)
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config)
        self.kv = KVCacheManager(
            block_size=config.cache.block_size,
            num_gpu_blocks=self.runner.num_gpu_blocks,
            num_cpu_blocks=self.runner.num_cpu_blocks,
            enable_prefix_caching=config.cache.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                preemption_mode=config.preemption_mode,
            ),
            self.kv,
        )
        self.sampler = Sampler()
        self.requests: dict[str, _Request] = {}
        self.eos_ids = frozenset(config.model.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self._seq_ids = itertools.count()

    # ---- requests ---------------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """A prompt's text (if any) and token ids, checked; ValueError with a clear message otherwise."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a prompt dict needs 'prompt_token_ids'")
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            vocab = self.config.model.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]!r} is out of range [0, {vocab})")
        elif isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt) if prompt else []
        else:
            raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.config.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than max_model_len ({self.config.max_model_len})"
            )
        return text, ids

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        """Queue a request; raises ValueError for a bad prompt or a duplicate id."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        seq = Sequence(next(self._seq_ids), ids)
        group = SequenceGroup(request_id, [seq], time.monotonic())
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        req = _Request(group, text, params, generator)
        req.states[seq.seq_id] = self._new_state(ids, params)
        self.requests[request_id] = req
        self.scheduler.add_seq_group(group)

    def _new_state(self, prompt_ids: list[int], params: SamplingParams) -> _SeqState:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        return _SeqState(detok, logprobs=[] if params.logprobs is not None else None)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; all its blocks go back to the pool."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort_seq_group(request_id)
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting, running or swapped."""
        return bool(self.requests)

    # ---- the step ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, move blocks, run the model, sample, append tokens, check stops."""
        out = self.scheduler.schedule()
        outputs = [self._finish_ignored(rid, reason) for rid, reason in out.ignored]
        logits = self.runner.execute(out)
        self.scheduler.update_from_output(out)
        if logits is not None:
            outputs += self._process(out, logits)
        return [o for o in outputs if o is not None]

    def _finish_ignored(self, request_id: str, reason: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.error = reason
        return self._output(req)

    def _process(self, out: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        sampled = [s for s in out.scheduled if s.do_sample]
        rows = []
        for s in sampled:
            req = self.requests[s.request_id]
            seq = _find(req.group, s.seq_id)
            banned: tuple[int, ...] = ()
            if len(seq.output_token_ids) < req.params.min_tokens:
                banned = tuple(self.eos_ids | set(req.params.stop_token_ids))
            rows.append(SamplingRow(req.params, seq.token_ids[: seq.prompt_len], seq.output_token_ids,
                                    req.generator, banned))
        result = self.sampler(logits, rows)
        touched: dict[str, _Request] = {}
        for i, s in enumerate(sampled):
            req = self.requests[s.request_id]
            seq = _find(req.group, s.seq_id)
            self._append(req, seq, i, result)
            touched[s.request_id] = req
        outputs = []
        for rid, req in touched.items():
            outputs.append(self._output(req))
            if req.group.is_finished():
                del self.requests[rid]
        return outputs

    def _append(self, req: _Request, seq: Sequence, row: int, result: SamplerOutput) -> None:
        token = result.token_ids[row]
        seq.append_token(token)
        state = req.states[seq.seq_id]
        if result.logprobs is not None:
            state.cumulative_logprob += result.logprobs[row]
            if state.logprobs is not None:
                state.logprobs.append(self._logprob_entry(req.params, row, result))
        state.text += state.detok.step([token])
        status = self._check_stop(req, seq, state, token)
        if status is not None:
            if not isinstance(state.stop_reason, str):  # a stop string already cut the text
                state.text += state.detok.flush()
            self.scheduler.finish_seq(seq, status)

    def _logprob_entry(self, params: SamplingParams, row: int, result: SamplerOutput) -> dict[int, Logprob]:
        assert result.logprobs is not None and result.top_ids is not None and result.top_logprobs is not None
        k = params.logprobs or 0
        entry = {
            t: Logprob(lp, rank + 1, self.tokenizer.decode([t], False))
            for rank, (t, lp) in enumerate(zip(result.top_ids[row][:k], result.top_logprobs[row][:k], strict=True))
        }
        token = result.token_ids[row]
        assert result.ranks is not None
        entry.setdefault(token, Logprob(result.logprobs[row], result.ranks[row], self.tokenizer.decode([token], False)))
        return entry

    def _check_stop(self, req: _Request, seq: Sequence, state: _SeqState, token: int) -> SequenceStatus | None:
        """The finished status this token gives the sequence, or None to go on."""
        params = req.params
        n_out = len(seq.output_token_ids)
        if n_out >= params.min_tokens:
            if token in params.stop_token_ids:
                state.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in self.eos_ids:
                return SequenceStatus.FINISHED_STOPPED
            for stop in params.stop:
                # Only the tail can hold a new match: the last delta plus a stop string's length.
                at = state.text.find(stop, max(0, len(state.text) - len(stop) - 64))
                if at >= 0:
                    state.text = state.text[: at + len(stop)] if params.include_stop_str_in_output else state.text[:at]
                    state.stop_reason = stop
                    return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _output(self, req: _Request) -> RequestOutput:
        group = req.group
        outputs = []
        for index, seq in enumerate(group.seqs):
            state = req.states[seq.seq_id]
            reason = _FINISH_REASON.get(seq.status)
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=state.text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=state.cumulative_logprob if req.params.logprobs is not None else None,
                    logprobs=state.logprobs,
                    finish_reason=reason,
                    stop_reason=state.stop_reason,
                )
            )
        return RequestOutput(
            request_id=group.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(group.seqs[0].token_ids[: group.seqs[0].prompt_len]),
            outputs=outputs,
            finished=group.is_finished(),
            error=req.error,
        )


def _find(group: SequenceGroup, seq_id: int) -> Sequence:
    """The sequence of a group with this id."""
    return next(s for s in group.seqs if s.seq_id == seq_id)
