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
from tinypaged.engine.beam_search import BeamSearch, beam_outputs, step_beams
from tinypaged.engine.model_runner import ModelRunner
from tinypaged.engine.output_processor import (
    SeqState,
    check_stop,
    completion,
    logprob_entry,
    prompt_logprob_entries,
)
from tinypaged.engine.sampler import SampledBatch, Sampler, SamplingRow, has_penalty, seq_seed, upload
from tinypaged.engine.staging import PendingTokens
from tinypaged.outputs import Logprob, RequestOutput
from tinypaged.sampling_params import SamplingParams
from tinypaged.tokenizer import IncrementalDetokenizer, Tokenizer

Prompt = str | dict[str, list[int]]


class EngineError(RuntimeError):
    """A request failed inside the engine (not because of its input); the message says why."""


class StepError(EngineError):
    """A step raised: the requests it concerned were aborted (their blocks freed); the rest go on."""

    def __init__(self, message: str, request_ids: list[str], outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.request_ids = request_ids  # the failed requests
        self.outputs = outputs  # outputs of other requests produced before the failure (e.g. ignored ones)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load, for /metrics and tests."""

    num_running: int  # requests
    num_waiting: int
    num_swapped: int
    gpu_cache_usage: float  # 0..1 of the KV blocks in use
    cpu_cache_usage: float  # 0..1 of the swap blocks in use
    num_preemptions: int  # total so far
    prompt_tokens_total: int  # prompt tokens of requests whose prefill completed
    generation_tokens_total: int  # tokens sampled (beam search: one per live beam per step)


@dataclass(eq=False)
class Request:
    """One request: its group, parameters, the state of its sequences and (beam search) of its beams."""

    group: SequenceGroup
    prompt: str | None
    params: SamplingParams
    states: dict[int, SeqState] = field(default_factory=dict)
    beam: BeamSearch | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None


@dataclass(eq=False)
class _Sampling:
    """One step's sampling as queued on the device, applied to its sequences once the tokens reach the host.

    A deferred step (async scheduling) is applied during the next step, after that step's forward pass has
    been queued: its sequences carry the sampled tokens as pending until then.
    """

    targets: list[tuple[Request, Sequence, int | None]]  # (request, seq, fork index or None) per sampled row
    sampled: SampledBatch | None
    beam_targets: list[tuple[Request, Sequence]]
    beam_logprobs: torch.Tensor | None
    touched: dict[str, Request]
    deferred: bool = False

    def pending_tokens(self) -> PendingTokens:
        """Where the next step finds each sequence's token (deferred steps only)."""
        assert self.sampled is not None
        return PendingTokens(
            self.sampled.token_ids, {seq.seq_id: i for i, (_, seq, _) in enumerate(self.targets)}
        )


class LLMEngine:
    """The synchronous engine: `add_request`, then `step()` until `has_unfinished_requests()` is False.

    With async scheduling (on by default on a GPU) a step queues its forward pass and sampling, then applies
    the previous step's tokens while the device works, so the host's scheduling, detokenizing and output
    building overlap the device. Its outputs come one step later; steps whose tokens the next step's
    scheduling or sampling needs on the host (beam search, the forks of n > 1, penalties) are applied at once.
    A sequence preempted while its token is pending gets the token before it can be scheduled again: the
    deferred step is applied in the same call that preempted it.
    """

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
        self.requests: dict[str, Request] = {}
        self.eos_ids = frozenset(config.model.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self._seq_ids = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.runner.device.type == "cuda"
        )
        self._inflight: _Sampling | None = None  # a deferred step, applied during the next one

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
            raise ValueError(
                f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.config.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than max_model_len ({self.config.max_model_len})"
            )
        return text, ids

    def check_params(self, params: SamplingParams) -> None:
        """SamplingParams checks that depend on the engine; ValueError if they fail."""
        params.verify()
        if params.prompt_logprobs is not None and self.config.cache.enable_prefix_caching:
            raise ValueError(
                "prompt_logprobs cannot be used with prefix caching (cached prompt tokens are not run)"
            )
        if params.use_beam_search and params.stop:
            raise ValueError("stop strings are not supported with beam search; use stop_token_ids")
        if params.num_seqs > self.config.max_num_seqs:
            raise ValueError(
                f"best_of/n ({params.num_seqs}) exceeds max_num_seqs ({self.config.max_num_seqs})"
            )

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        """Queue a request; raises ValueError for a bad prompt or params, or a duplicate id."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_params(params)
        text, ids = self.tokenize_prompt(prompt)
        seq = Sequence(next(self._seq_ids), ids)
        req = Request(SequenceGroup(request_id, [seq], time.monotonic()), text, params)
        if params.use_beam_search:
            stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
            limit = self.config.max_model_len - len(ids)
            req.beam = BeamSearch(
                params, stop_ids, min(params.max_tokens or limit, limit), beams=[seq.seq_id]
            )
        seed_key = seq_seed(params.seed, 0) if params.seed is not None else None
        req.states[seq.seq_id] = self._new_state(req, ids, 0, seed_key)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self.requests[request_id] = req
        self.scheduler.add_seq_group(req.group)

    def _new_state(self, req: Request, prompt_ids: list[int], index: int, seed_key: int | None) -> SeqState:
        params = req.params
        detok = (
            None
            if req.beam
            else IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        )
        return SeqState(index, detok, seed_key, logprobs=[] if params.logprobs is not None else None)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; all its blocks go back to the pool at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort_seq_group(request_id)
        if not self.requests:
            self._inflight = None  # nothing left that its tokens could go to
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting, running or swapped."""
        return bool(self.requests)

    def stats(self) -> EngineStats:
        """Queue lengths, cache usage and token counters right now."""
        kv, sched = self.kv, self.scheduler
        cpu_usage = 1.0 - kv.num_free_cpu_blocks / kv.num_cpu_blocks if kv.num_cpu_blocks else 0.0
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_swapped=sched.num_swapped,
            gpu_cache_usage=kv.gpu_usage,
            cpu_cache_usage=cpu_usage,
            num_preemptions=sched.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )

    # ---- the step ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, move blocks, run the model, sample, append tokens, check stops.

        Under async scheduling the tokens appended are the previous step's (this step's stay pending on the
        device until the next call). If anything after schedule() raises, the requests of this step (and of
        a deferred one) are aborted and StepError says which.
        """
        outputs: list[RequestOutput] = []
        prev, self._inflight = self._inflight, None
        out: SchedulerOutput | None = None
        try:
            out = self.scheduler.schedule()
            outputs += [o for o in (self._finish_ignored(rid, reason) for rid, reason in out.ignored) if o]
            pending = prev.pending_tokens() if prev is not None else None
            logits = self._execute(out, pending)
            self.scheduler.update_from_output(out)
            launched = self._sample(out, logits) if logits is not None else None
            if prev is not None:
                outputs += self._apply(prev)
                prev = None
            if launched is not None and launched.deferred:
                self._inflight = launched
            elif launched is not None:
                outputs += self._apply(launched)
        except Exception as e:
            failed = self._fail_step(out, prev)
            raise StepError(f"engine step failed: {type(e).__name__}: {e}", failed, outputs) from e
        if not self.requests:
            self._inflight = None
        return outputs

    def _execute(self, out: SchedulerOutput, pending: PendingTokens | None) -> torch.Tensor | None:
        """The runner's step: the logits of the rows that sample. Requests with prompt_logprobs get the logits
        of their prompt chunk from the same forward pass and add its entries."""
        want = [i for i, s in enumerate(out.scheduled) if self._wants_prompt_logprobs(s.request_id, s.seq_id)]
        result = self.runner.execute(out, want, pending)
        if result is None:
            return None
        for i, chunk in result.prompt_logits.items():
            s = out.scheduled[i]
            req = self.requests[s.request_id]
            assert req.prompt_logprobs is not None
            req.prompt_logprobs += prompt_logprob_entries(
                self.tokenizer,
                chunk,
                req.group.seqs[0].prompt_token_ids,
                s.num_computed_tokens,
                len(req.prompt_logprobs),
                req.params.prompt_logprobs or 0,
            )
        return result.logits

    def _wants_prompt_logprobs(self, request_id: str, seq_id: int) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.prompt_logprobs is None or req.group.seqs[0].seq_id != seq_id:
            return False
        return len(req.prompt_logprobs) < req.group.seqs[0].prompt_len

    def _finish_ignored(self, request_id: str, reason: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.error = reason
        return self._output(req)

    def _fail_step(self, out: SchedulerOutput | None, prev: _Sampling | None) -> list[str]:
        """Abort the requests a failed step touched: scheduled, swapped out (their copies may be torn), or
        waiting for the tokens of a deferred step that was not applied."""
        ids: dict[str, None] = {}
        if prev is not None:
            ids.update(
                dict.fromkeys(
                    r.group.request_id for r, _, _ in prev.targets if r.group.request_id in self.requests
                )
            )
        if out is not None:
            ids.update(dict.fromkeys(s.request_id for s in out.scheduled))
            if out.blocks_to_swap_out:
                ids.update(dict.fromkeys(out.preempted))
        for rid in ids:
            self.requests.pop(rid, None)
            self.scheduler.abort_seq_group(rid)
        return list(ids)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> _Sampling:
        """Queue the sampling of every row in one pass (beam rows: their log-probabilities); defer it when
        async scheduling is on and nothing in it needs the tokens on the host before the next step."""
        rows: list[SamplingRow] = []
        src: list[int] = []  # the logits row of each sampling row
        targets: list[tuple[Request, Sequence, int | None]] = []
        beam_rows: list[SamplingRow] = []
        beam_src: list[int] = []
        beam_targets: list[tuple[Request, Sequence]] = []
        touched: dict[str, Request] = {}
        penalties = False
        for i, s in enumerate(s for s in out.scheduled if s.do_sample):
            req = self.requests.get(s.request_id)
            seq = self.scheduler.get_seq(s.seq_id)
            if req is None or seq is None or seq.status != SequenceStatus.RUNNING:
                continue
            touched[s.request_id] = req
            p = req.params
            num_outputs = seq.num_tokens - seq.prompt_len  # counting tokens pending on the device
            penalised = has_penalty(p)
            penalties |= penalised
            prompt_ids = seq.token_ids[: seq.prompt_len] if p.repetition_penalty != 1.0 else []
            output_ids = seq.token_ids[seq.prompt_len :] if penalised or req.beam else []
            banned = tuple(self.eos_ids | set(p.stop_token_ids)) if num_outputs < p.min_tokens else ()
            state = req.states[seq.seq_id]
            if req.beam is not None:
                beam_rows.append(SamplingRow(p, prompt_ids, output_ids, None, banned, num_outputs))
                beam_src.append(i)
                beam_targets.append((req, seq))
            elif p.num_seqs > 1 and num_outputs == 0 and len(req.group.seqs) == 1:
                # The prompt is computed: draw one first token per sequence of the request, each from its
                # own stream; the children fork from the prompt's blocks when the tokens are applied.
                for j in range(p.num_seqs):
                    key = seq_seed(p.seed, j) if p.seed is not None else None
                    rows.append(SamplingRow(p, prompt_ids, output_ids, key, banned, num_outputs))
                    src.append(i)
                    targets.append((req, seq, j))
            else:
                rows.append(SamplingRow(p, prompt_ids, output_ids, state.seed_key, banned, num_outputs))
                src.append(i)
                targets.append((req, seq, None))
        sampled = beam_lp = None
        if rows:
            need_lp = any(r.params.num_seqs > r.params.n for r in rows)
            sampled = self.sampler.sample(_rows_of(logits, src), rows, need_logprobs=need_lp)
        if beam_rows:
            beam_lp = self.sampler.beam_logprobs(_rows_of(logits, beam_src), beam_rows)
        deferred = (
            self.async_scheduling
            and sampled is not None
            and not beam_rows
            and not penalties
            and all(j is None for _, _, j in targets)
        )
        if deferred:
            for _, seq, _ in targets:
                seq.add_pending()
        return _Sampling(targets, sampled, beam_targets, beam_lp, touched, deferred)

    def _apply(self, sampling: _Sampling) -> list[RequestOutput]:
        """Append a step's tokens (forking parallel-sampling groups after their prompt, stepping beams),
        check stops, and build the outputs of the requests it touched."""
        if sampling.sampled is not None:
            result = sampling.sampled.result()
            targets = sampling.targets
            # Fork first, so every child copies its parent before the parent's first token is appended.
            seqs = [self._fork(req, seq, j) if j else seq for req, seq, j in targets]
            for row, ((req, _, _), seq) in enumerate(zip(targets, seqs, strict=True)):
                if sampling.deferred and (
                    self.requests.get(req.group.request_id) is not req or seq.status.is_finished
                ):
                    continue  # aborted or finished while this step was in flight
                token = result.token_ids[row]
                state = req.states[seq.seq_id]
                if result.logprobs is not None:
                    state.cumulative_logprob += result.logprobs[row]
                    if state.logprobs is not None:
                        state.logprobs.append(logprob_entry(self.tokenizer, req.params, row, result))
                self._append(req, seq, token, sampling.deferred)
                status = check_stop(req.params, seq, state, token, self.eos_ids, self.config.max_model_len)
                if status is not None:
                    self.scheduler.finish_seq(seq, status)
        if sampling.beam_logprobs is not None:
            lp = sampling.beam_logprobs
            for row, (req, seq) in enumerate(sampling.beam_targets):
                assert req.beam is not None
                req.beam.pending[seq.seq_id] = lp[row]
            for req in dict.fromkeys(r for r, _ in sampling.beam_targets):
                step_beams(req, self.scheduler, self.tokenizer, self._fork, self._append)
        outputs = []
        for rid, req in sampling.touched.items():
            if self.requests.get(rid) is not req:
                continue  # aborted while in flight: abort_request reported it
            outputs.append(self._output(req))
            if req.group.is_finished():
                del self.requests[rid]
        return outputs

    def _fork(self, req: Request, parent: Sequence, index: int) -> Sequence:
        """A new sequence of the request sharing every block of `parent` (copy-on-write later)."""
        child = parent.fork(next(self._seq_ids))
        self.scheduler.fork_seq(parent, child)
        p = req.params
        key = seq_seed(p.seed, index) if p.seed is not None else None
        if req.beam is not None:
            req.states[child.seq_id] = req.states[parent.seq_id].fork(index, key)
        else:
            req.states[child.seq_id] = self._new_state(req, parent.prompt_token_ids, index, key)
        return child

    def _append(self, req: Request, seq: Sequence, token: int, pending: bool = False) -> None:
        """Append a sampled token (`pending`: the one the sequence was already running as pending)."""
        if len(seq.token_ids) == seq.prompt_len and seq is req.group.seqs[0]:
            self.prompt_tokens_total += seq.prompt_len
        if pending:
            seq.resolve_pending(token)
        else:
            seq.append_token(token)
        self.generation_tokens_total += 1

    def _output(self, req: Request) -> RequestOutput:
        group, p = req.group, req.params
        first = group.seqs[0]
        if req.beam is not None:
            outputs = beam_outputs(self.tokenizer, req)
        else:
            seqs = group.seqs
            if p.num_seqs > p.n:
                # best_of: the n sequences with the highest cumulative logprob, once all are done.
                if group.is_finished():
                    seqs = sorted(seqs, key=lambda s: req.states[s.seq_id].cumulative_logprob, reverse=True)
                seqs = seqs[: p.n]
            outputs = [completion(p, s, req.states[s.seq_id], i) for i, s in enumerate(seqs)]
        return RequestOutput(
            request_id=group.request_id,
            prompt=req.prompt,
            prompt_token_ids=first.token_ids[: first.prompt_len],
            outputs=outputs,
            finished=group.is_finished(),
            error=req.error,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
        )


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The given rows of the step's logits (the whole tensor when they are all of them, in order)."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[upload(rows, torch.int64, logits.device)]
