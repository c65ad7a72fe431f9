"""LLMEngine: requests in; each `step()` schedules, executes, samples and updates; RequestOutputs out.

One job, in about 480 lines: the order of a step's phases and what each hands the next (admission, the
speculator's proposals, schedule, execute, sample and verify, apply), with the failure of one request or of the
step at each phase; the phases' own work lives in the modules they call.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import Callable
from typing import Literal, NoReturn

import torch

from tinypaged.config import EngineConfig
from tinypaged.core.scheduler import Scheduler, SchedulerOutput
from tinypaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from tinypaged.engine.device.executor import Executor
from tinypaged.engine.device.model_runner import ExecuteOutput
from tinypaged.engine.request import EngineRequest, Fork, Plan, Prompt, Request
from tinypaged.engine.sampling.beam_search import BeamSearch
from tinypaged.engine.sampling.draw_batch import DrawBatch
from tinypaged.engine.sampling.grammar_state import GrammarState
from tinypaged.engine.sampling.parallel_sampling import ParallelSampling
from tinypaged.engine.sampling.sampler import Sampler
from tinypaged.engine.sampling.structured import GrammarCompiler
from tinypaged.engine.speculative.speculator import make_speculator
from tinypaged.engine.step import warmup
from tinypaged.engine.step.inputs import InputProcessor
from tinypaged.engine.step.output_processor import GrammarError, OutputProcessor
from tinypaged.engine.step.queued_step import QueuedStep, StepError
from tinypaged.engine.step.stats import EngineSnapshot, EngineStats, StepResult, StepStats, StepTimer
from tinypaged.errors import ConfigError, EngineDeadError, RequestError
from tinypaged.outputs import RequestMetrics, RequestOutput
from tinypaged.sampling_params import RequestOutputKind, SamplingParams
from tinypaged.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
UNUSABLE = "no usable next-token distribution: every token is banned, or the logits are not finite"


class LLMEngine:
    """The synchronous engine: `add_request`, then `step()` until `has_unfinished_requests()` is False.

    A step reads top to bottom: schedule (core/) -> execute (the runner queues block moves and the forward
    pass) -> sample (one sampler pass over every draw the requests' strategies ask for) -> update (each
    strategy's plan applied: forks, appends, drops; the output processor detokenizes and checks stops).
    With async scheduling (on by default on a GPU) a step's tokens stay on the device and are applied during
    the next step, after that step's forward pass has been queued, so the host's work overlaps the device's;
    a step whose tokens the next schedule or sampling needs on the host (a fork, a beam step, penalties) is
    applied at once. A sequence preempted while its token is pending gets the token before it can run again:
    the deferred step is applied in the same call that preempted it.

    The executor runs each step on every tensor-parallel rank (one, by default); `runner` is rank 0's, in this
    process. If the group fails (a worker died or hung) every request is aborted and `step()` raises
    EngineDeadError, now and after; `shutdown()` ends every rank.
    """

    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        self.tokenizer = Tokenizer(config.tokenizer_path)
        if config.tokenizer is not None and self.tokenizer.vocab_size > config.model_config.vocab_size:
            raise ConfigError(
                f"tokenizer {config.tokenizer} has {self.tokenizer.vocab_size} tokens, more than the model's "
                f"vocabulary ({config.model_config.vocab_size})"
            )
        torch.manual_seed(config.seed)
        self.executor = Executor(config)
        self.runner = self.executor.runner
        self.kv = config.kv_cache_manager(self.runner.num_gpu_blocks, self.runner.num_cpu_blocks)
        self.scheduler = Scheduler(config.scheduler_config(), self.kv)
        self.sampler = Sampler()
        self.eos_ids = frozenset(config.model_config.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self.grammars = GrammarCompiler(
            config.tokenizer_path / "tokenizer.json", config.model_config.vocab_size, sorted(self.eos_ids)
        )
        self.inputs = InputProcessor(config, self.tokenizer, self.grammars)
        self.output = OutputProcessor(self.tokenizer, self.eos_ids, config.max_model_len)
        auto = self.runner.device.type == "cuda"
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None else auto
        self._requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._num_steps = 0
        self._inflight: QueuedStep | None = None  # a deferred step, applied during the next one
        # Requests waiting for their grammar to compile, and those that follow one (their token masks).
        self.grammar_state = GrammarState(self.grammars)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.speculator = make_speculator(config, self.runner)  # speculative decoding (if configured)
        self.startup = warmup.start(self, started)  # no request after this waits on a compile
        # What exists now (the model's modules, the block pool, imported libraries: some 300k objects) lives as
        # long as the engine. Moved out of the cyclic collector's view, it is no longer traversed by the full
        # collections that each step's short-lived objects trigger (tens of ms each); refcounting still frees
        # it, so a dropped engine's memory comes back as before.
        gc.collect()
        gc.freeze()

    # ---- requests ---------------------------------------------------------------------------------------

    def process_inputs(self, request_id: str, prompt: Prompt, params: SamplingParams) -> EngineRequest:
        """Check a request and tokenize its prompt (RequestError naming the parameter if it cannot run);
        nothing is queued: `add` queues what this returns."""
        return self.inputs.process(request_id, prompt, params)

    def add(self, request: EngineRequest) -> None:
        """Queue a checked request (see `process_inputs`); RequestError if its id is in use or its grammar is
        known to be bad. A request whose grammar still compiles (or failed for another reason) waits for it
        outside the scheduler, and ends at the next step if it failed."""
        if request.request_id in self._requests:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        grammar = request.grammar
        if grammar is not None:
            GrammarState.check(grammar)
        params, ids = request.params, request.prompt_token_ids
        seq = Sequence(next(self._seq_ids), ids)
        # A prompt that is scored (prompt_logprobs) runs whole: a prefix-cache hit would skip its tokens.
        group = SequenceGroup(
            request.request_id,
            [seq],
            request.arrival_time if request.arrival_time is not None else time.monotonic(),
            reads_prefix_cache=params.prompt_logprobs is None,
            client_request_id=request.client_request_id,
            max_tokens=params.max_tokens,
        )
        strategy = self._strategy(params, len(ids))
        req = Request(group, request.prompt, list(ids), params, strategy, RequestMetrics(group.arrival_time))
        self.output.start(req)
        self._requests[request.request_id] = req
        # A request with a grammar still compiling (or failed) waits for it outside the scheduler.
        if grammar is None or self.grammar_state.admit(req, grammar):
            self.scheduler.add_seq_group(group)

    def _admit(self) -> list[RequestOutput]:
        """Before a schedule: the tensor-parallel group is alive (EngineDeadError if not); requests whose grammar
        is now compiled go to the scheduler, those whose grammar failed (or ran past the compile time limit)
        end with the reason (their outputs). With nothing else to run, wait a little for a compile rather than
        spin through empty steps."""
        self.executor.check()
        if not self.grammar_state.compiling:
            return []
        started, failed = self.grammar_state.compiled(idle=not self.scheduler.has_unfinished())
        for req in started:
            self.scheduler.add_seq_group(req.group)
        for req in failed:
            del self._requests[req.request_id]
        return [self.output.failed(req) for req in failed]

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        """Check and queue a request (RequestError if it cannot run)."""
        self.add(self.process_inputs(request_id, prompt, params))

    def _strategy(self, params: SamplingParams, prompt_len: int) -> ParallelSampling | BeamSearch:
        if not params.use_beam_search:
            return ParallelSampling(params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        limit = self.config.max_model_len - prompt_len
        return BeamSearch(params, stop_ids, min(params.max_tokens or limit, limit), self.tokenizer)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; all its blocks go back to the pool at once. Its last output (None
        if the request is unknown or already finished)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self.grammar_state.abort(request_id)  # if still compiling: never scheduled
        self.scheduler.abort_seq_group(request_id)
        if not self._requests:
            self._inflight = None  # nothing left that its tokens could go to
        return self.output.output(req)

    def abort_all(self) -> list[RequestOutput]:
        """Abort every unfinished request; their last outputs."""
        outputs = [self.abort_request(rid) for rid in list(self._requests)]
        return [o for o in outputs if o is not None]

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting, running or swapped."""
        return bool(self._requests)

    def stats(self) -> EngineStats:
        """Queue lengths, cache usage and counters right now."""
        counters = self._num_steps, self.prompt_tokens_total, self.generation_tokens_total
        compiling = self.grammar_state.num_waiting()
        spec = self.speculator.totals.as_tuple()
        return EngineStats.of(
            self.scheduler, self.kv, self._requests, compiling, counters, self.startup, spec
        )

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (nothing changed) while requests hold blocks."""
        return not self._requests and self.kv.reset_prefix_cache()

    def check_integrity(self) -> None:
        """The KV cache manager's invariants (AssertionError if broken); call it between steps."""
        self.kv.check_integrity()

    def shutdown(self) -> None:
        """Abort what is left and stop every tensor-parallel rank (their devices freed); the engine cannot
        run afterwards. Idempotent."""
        self.abort_all()
        self.grammars.shutdown()
        self.executor.shutdown()

    def snapshot(self) -> EngineSnapshot:
        """The KV block pools with their holders' request ids, and stats(); call it between steps."""
        return EngineSnapshot(self.scheduler.cache_snapshot(), self.stats())

    # ---- the step ---------------------------------------------------------------------------------------

    def step(self) -> StepResult:
        """One iteration: schedule, execute, sample, update. Returns the outputs of the requests it advanced
        and its statistics.

        Under async scheduling the tokens applied are the previous step's (this step's stay pending on the
        device until the next call). If anything after schedule() raises, the requests of this step (and of a
        deferred one) are aborted and StepError says which; if the tensor-parallel group has failed, every
        request is aborted and EngineDeadError says why.
        """
        timer, index, prev = StepTimer(), self._num_steps, self._inflight
        self._num_steps, self._inflight = index + 1, None
        outputs: list[RequestOutput] = []
        applied: list[QueuedStep] = []  # the steps whose tokens this call applies, in order
        sched: SchedulerOutput | None = None
        try:
            outputs += self._admit()
            self.speculator.propose(self.scheduler, self._requests)  # speculative decoding's proposals
            sched = self.scheduler.schedule()
            self.speculator.scheduled()
            self.speculator.preempted(self.scheduler, sched.preempted)
            preempted_pending = self._num_pending(sched.preempted)
            outputs += self._finish_ignored(sched.ignored)
            timer.scheduled()
            executed = self._execute(index, sched, prev, outputs)
            self.scheduler.update_from_output(sched)
            timer.executed()
            if prev is not None and prev.constrained:  # this step's masks start from the last step's tokens
                self._apply_step(prev, outputs, applied)
                timer.applied_early()
            queued = self._sample(index, sched, executed, outputs) if executed is not None else None
            timer.sampled()
            if prev is not None and not applied:  # the last step's tokens, while this step runs on the device
                self._apply_step(prev, outputs, applied)
            if queued is not None and queued.deferred:
                self._inflight = queued
            elif queued is not None:
                self._apply_step(queued, outputs, applied)
        except Exception as e:
            self._step_failed(e, index, sched, prev if prev not in applied else None, outputs)
        if not self._requests:
            self._inflight = None
            self.speculator.idle()
        timer.stop()
        graph = executed.graph if executed is not None else None
        kv = self.kv.num_free_gpu_blocks, self.scheduler.running, self.kv  # as the step leaves them
        events = tuple(self.kv.gpu_pool.take_events())
        stats = StepStats.of(
            index, sched, graph, queued, applied, outputs, timer, preempted_pending, *kv, kv_events=events
        )
        return StepResult(outputs, stats)

    def _apply_step(self, step: QueuedStep, outputs: list[RequestOutput], applied: list[QueuedStep]) -> None:
        """Apply a queued step's tokens (`_update`): its outputs into `outputs`, the step into `applied`."""
        outputs += self._update(step)
        applied.append(step)

    def _step_failed(
        self,
        e: Exception,
        index: int,
        sched: SchedulerOutput | None,
        prev: QueuedStep | None,
        outputs: list[RequestOutput],
    ) -> NoReturn:
        """Raise for a step that raised `e`: EngineDeadError (every request aborted) if the tensor-parallel
        group failed; else StepError naming the requests the step touched, aborted: scheduled, swapped out
        (their copies may be torn), or waiting for the tokens of `prev`, a deferred step not applied."""
        if isinstance(e, EngineDeadError) or self.executor.failure is not None:
            self.abort_all()  # no rank can run them any more
            raise e if isinstance(e, EngineDeadError) else EngineDeadError(self.executor.failure) from e
        # Not one request's fault (the schedule or the batch's forward pass): fail what the step touched.
        logger.exception("engine step %d failed", index)
        ids: dict[str, None] = {}
        if prev is not None:
            ids.update(dict.fromkeys(rid for rid in prev.request_ids() if rid in self._requests))
        if sched is not None:
            ids.update(dict.fromkeys(s.request_id for s in sched.scheduled))
            if sched.blocks_to_swap_out:
                ids.update(dict.fromkeys(sched.preempted))
        for rid in ids:
            self._requests.pop(rid, None)
            self.scheduler.abort_seq_group(rid)
        if not self._requests:
            self._inflight = None
        raise StepError(f"engine step {index} failed (an internal error, logged)", list(ids), outputs) from e

    def _num_pending(self, request_ids: tuple[str, ...]) -> int:
        """Sequences of these requests holding a token still pending on the device."""
        groups = (self.scheduler.get_seq_group(rid) for rid in request_ids)
        return sum(s.num_pending for g in groups if g is not None for s in g.seqs)

    def _finish_ignored(self, ignored: tuple[tuple[str, str], ...]) -> list[RequestOutput]:
        """Outputs of the requests the scheduler ended without running (they can never fit)."""
        outputs = []
        for request_id, reason in ignored:
            req = self._requests.pop(request_id, None)
            if req is not None:
                req.error, req.error_kind = reason, "ignored"
                outputs.append(self.output.output(req))
        return outputs

    def _fail_request(
        self,
        req: Request,
        message: str,
        step: int,
        fault: bool = True,
        kind: Literal["invalid", "internal"] = "internal",
    ) -> list[RequestOutput]:
        """End one request that failed inside `step` while the others go on: its blocks go back to the pool,
        its stream ends with `message` (never the fault's own text: that is logged, with the request id)."""
        if fault:
            logger.exception("request %s failed in engine step %d: %s", req.request_id, step, message)
        if self._requests.get(req.request_id) is not req:
            return []  # already ended
        del self._requests[req.request_id]
        self.scheduler.abort_seq_group(req.request_id)
        req.error, req.error_kind = message, kind
        return [self.output.failed(req)]

    def _fail_into(self, outputs: list[RequestOutput], message: str, step: int) -> Callable[[Request], None]:
        """A callback ending a request with `message` (`_fail_request`), its output into `outputs`."""
        return lambda req: outputs.extend(self._fail_request(req, message, step))

    def _grammar_failed(self, req: Request, error: str, step: int) -> list[RequestOutput]:
        """End a request whose matcher erred (`GrammarState.failure` says why): it fails with the reason."""
        if self._requests.get(req.request_id) is not req:
            return []  # already ended (another of its sequences failed first)
        message = self.grammar_state.failure(req, error, step)
        return self._fail_request(req, message, step, fault=False, kind="invalid")

    def _execute(
        self, index: int, sched: SchedulerOutput, prev: QueuedStep | None, failed: list[RequestOutput]
    ) -> ExecuteOutput | None:
        """The runner's step (queued, not awaited). Input tokens still on the device are read from the last
        step's samples; requests with prompt_logprobs get the logits of their prompt chunk and score it."""
        # A one-token chunk that samples is a decode, or a prompt's last token, which scores no prompt token.
        want = [
            i
            for i, s in enumerate(sched.scheduled)
            if (s.num_new_tokens > 1 or not s.do_sample)
            and (req := self._requests.get(s.request_id)) is not None
            and self.output.wants_prompt_logits(req, s.seq_id)
        ]
        result = self.executor.execute(sched, want, prev.pending_tokens() if prev is not None else None)
        if result is not None:
            for i, chunk in result.prompt_logits.items():
                s = sched.scheduled[i]
                req = self._requests[s.request_id]
                try:
                    self.output.add_prompt_logprobs(req, chunk, s.num_computed_tokens)
                except Exception:
                    failed += self._fail_request(req, "scoring its prompt failed", index)
        return result

    def _sample(
        self, index: int, sched: SchedulerOutput, executed: ExecuteOutput, failed: list[RequestOutput]
    ) -> QueuedStep:
        """Queue every draw the requests' strategies ask for, in one sampler pass (and one scoring pass for
        beam rows), grammars' masks applied first; defer the step when async scheduling is on and every draw
        may stay on the device. A request whose draws cannot be made fails alone (its output into `failed`)."""
        fail = self._fail_into(failed, "preparing its sampling failed", index)
        batch = DrawBatch.collect(
            sched.scheduled,
            self._requests,
            self.scheduler.get_seq,
            self.eos_ids,
            fail,
            self.speculator.draft_of,
        )
        logits = executed.logits
        num_failed, num_constrained, mask_s = len(failed), 0, 0.0
        if self.grammar_state.constrained:
            num_constrained, mask_s = self.grammar_state.mask(
                batch,
                logits,
                self._requests,
                lambda req, error: failed.extend(self._grammar_failed(req, error, index)),
            )
        if len(failed) > num_failed:
            batch.drop_ended(self._requests)  # requests that failed while their masks were filled
        fail = self._fail_into(failed, "sampling its next token failed", index)
        sampled, scores = batch.sample(self.sampler, logits, fail, index)
        spec = batch.verify(self.sampler, logits, fail, index)
        self.speculator.verified((d.seq.seq_id, len(d.spec), v) for _, d, v in spec)
        token, score = batch.token.draws, batch.score.draws
        deferred = (
            self.async_scheduling
            and not self.speculator.enabled  # the next proposals need this step's tokens on the host
            and all(d.defer for _, d in token + score)
        )
        if deferred:
            for _, d in token:
                d.seq.add_pending()
        return QueuedStep(
            index, token, sampled, score, scores, deferred, executed.events, num_constrained, mask_s, spec
        )

    def _update(self, step: QueuedStep) -> list[RequestOutput]:
        """Apply a step's results: each request's strategy plans, the plan is applied, its output built. A
        request whose distribution was unusable, or whose update raises, fails alone."""
        by_request, invalid = step.results()
        self.executor.check()  # the results of a step whose group failed meanwhile mean nothing
        outputs = []
        now = time.monotonic()  # when this step's tokens reach their requests (RequestOutput.metrics)
        for req, items in by_request.items():
            if self._requests.get(req.request_id) is not req:
                continue  # aborted while the step was in flight: abort_request reported it
            if req in invalid:
                outputs += self._fail_request(req, UNUSABLE, step.index, fault=False)
                continue
            try:
                for draw, samples in items:
                    if draw.spec:  # the positions of rejected proposals are given back first
                        self.scheduler.rollback(draw.seq, len(draw.spec) + 1 - len(samples))
                self._apply(req, req.strategy.plan(req, items), pending=step.deferred)
                req.metrics.tokens_at(now)
                finished = req.group.is_finished()
                if finished or req.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                    outputs.append(self.output.output(req))
            except GrammarError as e:  # a token its matcher refused: a limit of its grammar ran out
                outputs += self._grammar_failed(req, str(e), step.index)
                continue
            except Exception:
                outputs += self._fail_request(req, "applying its next token failed", step.index)
                continue
            if finished:
                del self._requests[req.request_id]
        return outputs

    def _apply(self, req: Request, plan: Plan, pending: bool) -> None:
        """Carry out a plan: forks first (each child shares its parent's blocks as they are before this
        step's tokens), then appends with their stop checks, then drops and finishes. `pending`: the tokens
        extend sequences that ran with them pending on the device."""
        children = {fork: self._fork(req, fork) for fork in plan.forks}
        for ext in plan.extend:
            seq = children[ext.target] if children and isinstance(ext.target, Fork) else ext.target
            if seq.status.is_finished:
                continue  # finished (or aborted) while its token was in flight
            self._append(req, seq, ext.sample.token, pending and seq is ext.target)
            status = self.output.append(req, seq, ext)
            if status is not None:
                self.scheduler.finish_seq(seq, status)
        for seq in plan.drop:
            self.scheduler.drop_seq(seq)
            del req.states[seq.seq_id]
        for seq in plan.finish:
            self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)

    def _fork(self, req: Request, fork: Fork) -> Sequence:
        """A new sequence of the request sharing every block of its parent (copy-on-write later)."""
        child = fork.parent.fork(next(self._seq_ids))
        self.scheduler.fork_seq(fork.parent, child)
        self.output.fork(req, fork.parent, child, fork.index)
        return child

    def _append(self, req: Request, seq: Sequence, token: int, pending: bool) -> None:
        """Append a token (`pending`: the one the sequence was already running as pending)."""
        if len(seq.token_ids) == seq.prompt_len and seq is req.group.seqs[0]:
            self.prompt_tokens_total += seq.prompt_len
        if pending:
            seq.resolve_pending(token)
        else:
            seq.append_token(token)
        self.generation_tokens_total += 1
