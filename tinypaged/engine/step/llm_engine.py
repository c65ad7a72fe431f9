"""LLMEngine: requests in; each `step()` schedules, executes, samples and updates; RequestOutputs out."""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from typing import Any, Literal

import torch
from llguidance import LLMatcher

from tinypaged import limits, ops
from tinypaged.config import EngineConfig
from tinypaged.core.kv_cache_manager import KVCacheManager
from tinypaged.core.scheduler import Scheduler, SchedulerOutput
from tinypaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from tinypaged.engine.device.executor import Executor
from tinypaged.engine.device.model_runner import ExecuteOutput
from tinypaged.engine.request import Draw, EngineRequest, Fork, Plan, Prompt, Request
from tinypaged.engine.sampling.beam_search import BeamSearch
from tinypaged.engine.sampling.parallel_sampling import ParallelSampling
from tinypaged.engine.sampling.sampler import SampledBatch, Sampler, SamplingRow, has_penalty, upload
from tinypaged.engine.sampling.structured import GrammarCompiler, bitmask_width, first_line, wait
from tinypaged.engine.step.inputs import InputProcessor
from tinypaged.engine.step.output_processor import GrammarError, OutputProcessor
from tinypaged.engine.step.queued_step import QueuedStep, StepError
from tinypaged.engine.step.stats import EngineSnapshot, EngineStats, StepResult, StepStats
from tinypaged.errors import EngineDeadError, RequestError
from tinypaged.outputs import RequestMetrics, RequestOutput
from tinypaged.sampling_params import RequestOutputKind, SamplingParams
from tinypaged.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


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
        self.config = config
        self.tokenizer = Tokenizer(config.model)
        torch.manual_seed(config.seed)
        self.executor = Executor(config)
        self.runner = self.executor.runner
        self.kv = KVCacheManager(
            block_size=config.block_size,
            num_gpu_blocks=self.runner.num_gpu_blocks,
            num_cpu_blocks=self.runner.num_cpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(config.scheduler_config(), self.kv)
        self.sampler = Sampler()
        self.eos_ids = frozenset(config.model_config.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self.grammars = GrammarCompiler(
            config.model_config.path / "tokenizer.json", config.model_config.vocab_size, sorted(self.eos_ids)
        )
        self.inputs = InputProcessor(config, self.tokenizer, self.grammars)
        self.output = OutputProcessor(self.tokenizer, self.eos_ids, config.max_model_len)
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.runner.device.type == "cuda"
        )
        self._requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._num_steps = 0
        self._inflight: QueuedStep | None = None  # a deferred step, applied during the next one
        # Requests waiting for their grammar to compile (in the grammar pool), with their compile deadline: the
        # scheduler sees them once it is ready, and the other requests run meanwhile.
        self._compiling: dict[str, tuple[Request, Future[LLMatcher], float]] = {}
        # Ids of the requests that follow a grammar, so that a step without any skips the masking entirely;
        # pruned each step of those that ended.
        self._constrained: set[str] = set()
        self._mask_s = 0.0  # this step's host time filling token masks (llguidance)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
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
        if grammar is not None and grammar.done() and not grammar.cancelled():
            error = grammar.exception()
            if isinstance(error, RequestError):
                raise error
        params, ids = request.params, request.prompt_token_ids
        seq = Sequence(next(self._seq_ids), ids)
        # A prompt that is scored (prompt_logprobs) runs whole: a prefix-cache hit would skip its tokens.
        group = SequenceGroup(
            request.request_id,
            [seq],
            request.arrival_time if request.arrival_time is not None else time.monotonic(),
            reads_prefix_cache=params.prompt_logprobs is None,
            client_request_id=request.client_request_id,
        )
        strategy = self._strategy(params, len(ids))
        req = Request(group, request.prompt, list(ids), params, strategy, RequestMetrics(group.arrival_time))
        self.output.start(req)
        self._requests[request.request_id] = req
        if grammar is None:
            self.scheduler.add_seq_group(group)
        elif grammar.done() and not grammar.cancelled() and grammar.exception() is None:
            self._start_constrained(req, grammar.result())
        else:
            deadline = time.monotonic() + limits.GRAMMAR_COMPILE_TIMEOUT_S
            self._compiling[request.request_id] = (req, grammar, deadline)

    def _start_constrained(self, req: Request, matcher: LLMatcher) -> None:
        """Hand a request whose matcher is built to the scheduler, its first sequence at the grammar's start."""
        req.constrained = True
        req.states[req.group.seqs[0].seq_id].matcher = matcher
        self._constrained.add(req.request_id)
        self.scheduler.add_seq_group(req.group)

    def _admit_compiled(self, outputs: list[RequestOutput]) -> None:
        """Requests whose grammar is now compiled go to the scheduler; those whose grammar failed (or ran past
        the compile time limit) end with the reason. With nothing else to run, wait a little for a compile
        rather than spin through empty steps."""
        if not self.scheduler.has_unfinished():
            pending = [f for _, f, _ in self._compiling.values()]
            futures.wait(pending, timeout=0.05, return_when=futures.FIRST_COMPLETED)
        now = time.monotonic()
        for request_id, (req, grammar, deadline) in list(self._compiling.items()):
            if not grammar.done() and now < deadline:
                continue
            del self._compiling[request_id]
            spec = req.params.structured_outputs
            try:
                result = wait(grammar, f"structured_outputs.{spec.kind if spec else ''}", timeout=0)
            except Exception as e:  # the spec at fault (RequestError), or its compile failed otherwise
                del self._requests[request_id]
                req.error, req.error_kind = str(e), "invalid" if isinstance(e, RequestError) else "internal"
                req.group.seqs[0].status = SequenceStatus.FINISHED_ABORTED
                outputs.append(self.output.failed(req))
                continue
            self._start_constrained(req, result)

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
        if self._compiling.pop(request_id, None) is not None:
            req.group.seqs[0].status = SequenceStatus.FINISHED_ABORTED  # never scheduled
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
        kv, sched = self.kv, self.scheduler
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting + len(self._compiling),
            num_waiting_seqs=sum(
                req.params.num_seqs for g in list(sched.waiting) if (req := self._requests.get(g.request_id))
            )
            + sum(req.params.num_seqs for req, _, _ in list(self._compiling.values())),
            num_swapped=sched.num_swapped,
            gpu_cache_usage=kv.gpu_usage,
            cpu_cache_usage=1.0 - kv.num_free_cpu_blocks / kv.num_cpu_blocks if kv.num_cpu_blocks else 0.0,
            num_gpu_blocks=kv.num_gpu_blocks,
            num_free_gpu_blocks=kv.num_free_gpu_blocks,
            num_cpu_blocks=kv.num_cpu_blocks,
            num_free_cpu_blocks=kv.num_free_cpu_blocks,
            num_preemptions=sched.num_preemptions,
            num_steps=self._num_steps,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            prefix_cache_queries_total=kv.num_prefix_queried_blocks,
            prefix_cache_hits_total=kv.num_prefix_hit_blocks,
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
        t0 = time.perf_counter()
        index = self._num_steps
        self._num_steps += 1
        prev, self._inflight = self._inflight, None
        outputs: list[RequestOutput] = []
        applied: list[QueuedStep] = []
        sched: SchedulerOutput | None = None
        self._mask_s = 0.0
        try:
            self.executor.check()
            if self._compiling:
                self._admit_compiled(outputs)
            sched = self.scheduler.schedule()
            preempted_pending = self._num_pending(sched.preempted)
            outputs += self._finish_ignored(sched.ignored)
            t1 = time.perf_counter()
            executed = self._execute(index, sched, prev, outputs)
            self.scheduler.update_from_output(sched)
            t2 = early = time.perf_counter()
            if prev is not None and prev.constrained:
                # This step's token masks start from the last step's tokens: apply them first (the host waits
                # for them while the device runs this step's forward pass), then fill the masks.
                outputs += self._update(prev)
                applied.append(prev)
                prev = None
                early = time.perf_counter()
            queued = self._sample(index, sched, executed, outputs) if executed is not None else None
            t3 = time.perf_counter()
            if prev is not None:  # the last step's tokens, while this step runs on the device
                outputs += self._update(prev)
                applied.append(prev)
                prev = None
            if queued is not None and queued.deferred:
                self._inflight = queued
            elif queued is not None:
                outputs += self._update(queued)
                applied.append(queued)
        except Exception as e:
            if isinstance(e, EngineDeadError) or self.executor.failure is not None:
                self.abort_all()  # no rank can run them any more
                raise e if isinstance(e, EngineDeadError) else EngineDeadError(self.executor.failure) from e
            # Not one request's fault (the schedule or the batch's forward pass): fail what the step touched.
            logger.exception("engine step %d failed", index)
            failed = self._fail_step(sched, prev)
            raise StepError(f"engine step {index} failed (an internal error, logged)", failed, outputs) from e
        if not self._requests:
            self._inflight = None
        t4 = time.perf_counter()
        decode = partial = 0
        for s in sched.scheduled:
            decode += s.num_new_tokens == 1 and s.do_sample
            partial += not s.do_sample
        stats = StepStats(
            step=index,
            num_seqs=len(sched.scheduled),
            num_prefill_tokens=sched.num_batched_tokens - decode,
            num_decode_tokens=decode,
            num_partial_prefills=partial,
            num_draws=queued.num_draws if queued is not None else 0,
            num_constrained=queued.num_constrained if queued is not None else 0,
            graph_batch_size=executed.graph.batch_size if executed is not None else 0,
            graph_num_tokens=executed.graph.num_tokens if executed is not None else 0,
            num_preempted=len(sched.preempted),
            num_preempted_pending=preempted_pending,
            num_blocks_swapped_out=len(sched.blocks_to_swap_out),
            num_blocks_swapped_in=len(sched.blocks_to_swap_in),
            num_blocks_copied=len(sched.blocks_to_copy),
            num_ignored=len(sched.ignored),
            num_finished=sum(1 for o in outputs if o.finished),
            deferred=queued is not None and queued.deferred,
            applied_steps=tuple(s.index for s in applied),
            num_free_blocks=self.kv.num_free_gpu_blocks,
            num_kv_tokens=sum(
                s.num_computed_tokens
                for g in self.scheduler.running
                for s in g.seqs
                if not s.status.is_finished
            ),
            schedule_s=t1 - t0,
            execute_s=t2 - t1,
            sample_s=t3 - early,
            mask_s=self._mask_s,
            update_s=t4 - t3 + early - t2,
            wait_s=sum(s.wait_s for s in applied),
            total_s=t4 - t0,
            device_s=tuple(s.device_s for s in applied if s.device_s is not None),
        )
        return StepResult(outputs, stats)

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

    def _grammar_failed(self, req: Request, error: str, step: int) -> list[RequestOutput]:
        """End a request whose matcher entered llguidance's error state (a limit of its grammar run out, most
        often its lexer's states): it fails with the reason, never "stop" with a partial output. The lexer was
        this request's own: the next request with its spec starts on a fresh one."""
        if self._requests.get(req.request_id) is not req:
            return []  # already ended (another of its sequences failed first)
        spec = req.params.structured_outputs
        what = f"structured_outputs.{spec.kind}" if spec is not None else "structured_outputs"
        logger.warning("request %s: its %s failed in engine step %d: %s", req.request_id, what, step, error)
        message = f"the output could not follow its {what}: {error}"
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
        beam rows); defer the step when async scheduling is on and every draw may stay on the device. A
        request whose draws cannot be made fails alone (its output into `failed`)."""
        token: list[tuple[Request, Draw]] = []
        token_rows: list[SamplingRow] = []
        token_src: list[int] = []  # the logits row of each draw
        score: list[tuple[Request, Draw]] = []
        score_rows: list[SamplingRow] = []
        score_src: list[int] = []
        for row, s in enumerate(s for s in sched.scheduled if s.do_sample):
            req = self._requests.get(s.request_id)
            seq = self.scheduler.get_seq(s.seq_id)
            if req is None or seq is None or seq.status != SequenceStatus.RUNNING:
                continue
            try:
                draws = [(d, self._sampling_row(req, seq, d)) for d in req.strategy.draws(req, seq)]
            except Exception:
                failed += self._fail_request(req, "preparing its sampling failed", index)
                continue
            for draw, sampling_row in draws:
                lists = (score, score_rows, score_src) if draw.scores else (token, token_rows, token_src)
                lists[0].append((req, draw))
                lists[1].append(sampling_row)
                lists[2].append(row)
        logits = executed.logits
        num_failed, num_constrained = len(failed), 0
        if self._constrained:
            self._constrained.intersection_update(self._requests)
            num_constrained = self._mask(index, logits, token + score, token_src + score_src, failed)
        if len(failed) > num_failed:
            # Requests that failed while their masks were filled have no draws left.
            alive = [i for i, (req, _) in enumerate(token) if self._requests.get(req.request_id) is req]
            if len(alive) < len(token):
                token = [token[i] for i in alive]
                token_rows = [token_rows[i] for i in alive]
                token_src = [token_src[i] for i in alive]
            alive = [i for i, (req, _) in enumerate(score) if self._requests.get(req.request_id) is req]
            if len(alive) < len(score):
                score = [score[i] for i in alive]
                score_rows = [score_rows[i] for i in alive]
                score_src = [score_src[i] for i in alive]
        sampled = scores = None
        if token:
            best_of = any(r.params.num_seqs > r.params.n for r in token_rows)  # ranks samples by logprob

            def sample(rows: torch.Tensor, sampling_rows: list[SamplingRow]) -> SampledBatch:
                return self.sampler.sample(rows, sampling_rows, need_logprobs=best_of)

            sampled, token = self._isolated(sample, logits, token, token_rows, token_src, index, failed)
        if score:
            scores, score = self._isolated(
                self.sampler.beam_logprobs, logits, score, score_rows, score_src, index, failed
            )
        deferred = self.async_scheduling and all(d.defer for _, d in token + score)
        if deferred:
            for _, d in token:
                d.seq.add_pending()
        return QueuedStep(index, token, sampled, score, scores, deferred, executed.events, num_constrained)

    def _mask(
        self,
        index: int,
        logits: torch.Tensor,
        draws: list[tuple[Request, Draw]],
        src: list[int],
        failed: list[RequestOutput],
    ) -> int:
        """Structured outputs: set the logits of every token its grammar forbids to -inf, in place, on the rows
        of the draws that follow one. Returns how many draws do. The masks are filled on the host (in
        llguidance's threads) while the device runs the forward pass, then uploaded and applied by one op.

        A row's draws share a matcher state (a fork's first draw is its parent's), so each row is filled
        once. A matcher in an error state, before or after its mask (past one of llguidance's limits: its mask
        then allows only EOS), fails its request alone (`_grammar_failed`)."""
        rows: dict[int, Any] = {}  # logits row -> its matcher
        owners: dict[int, Request] = {}
        count = 0
        for (req, draw), row in zip(draws, src, strict=True):
            if not req.constrained or self._requests.get(req.request_id) is not req:
                continue
            matcher = req.states[draw.seq.seq_id].matcher
            if matcher is None or matcher.is_error():
                error = first_line(matcher) if matcher is not None else "no matcher"
                failed += self._grammar_failed(req, error, index)
                continue
            rows[row], owners[row] = matcher, req
            count += 1
        if not rows:
            return count
        cuda = logits.device.type == "cuda"
        bitmask = torch.empty((len(rows), bitmask_width(logits.shape[1])), dtype=torch.int32, pin_memory=cuda)
        t0 = time.perf_counter()
        self.grammars.fill_bitmask(list(rows.values()), bitmask)
        self._mask_s += time.perf_counter() - t0
        for row, matcher in rows.items():
            if matcher.is_error():
                failed += self._grammar_failed(owners[row], first_line(matcher), index)
        with torch.inference_mode():  # the logits are the runner's inference tensors, written in place
            ops.apply_token_bitmask(
                logits,
                bitmask.to(logits.device, non_blocking=True),
                upload(list(rows), torch.int32, logits.device),
            )
        return count

    def _isolated(
        self,
        run: Callable[[torch.Tensor, list[SamplingRow]], Any],
        logits: torch.Tensor,
        draws: list[tuple[Request, Draw]],
        rows: list[SamplingRow],
        src: list[int],
        index: int,
        failed: list[RequestOutput],
    ) -> tuple[Any, list[tuple[Request, Draw]]]:
        """`run` over every row at once; if it raises, find the requests at fault by running each request's
        rows alone, end them, and run the rest together. Returns the result and the draws it covers."""
        try:
            return run(_rows_of(logits, src), rows), draws
        except Exception:
            logger.exception("engine step %d: the sampler failed; looking for the requests at fault", index)
        keep: list[int] = []
        for req in dict.fromkeys(req for req, _ in draws):
            mine = [i for i, (r, _) in enumerate(draws) if r is req]
            try:
                run(_rows_of(logits, [src[i] for i in mine]), [rows[i] for i in mine])
            except Exception:
                failed += self._fail_request(req, "sampling its next token failed", index)
                continue
            keep += mine
        if not keep:
            return None, []
        result = run(_rows_of(logits, [src[i] for i in keep]), [rows[i] for i in keep])
        return result, [draws[i] for i in keep]

    def _sampling_row(self, req: Request, seq: Sequence, draw: Draw) -> SamplingRow:
        p = req.params
        num_outputs = seq.num_tokens - seq.prompt_len  # counting tokens pending on the device
        prompt_ids = seq.token_ids[: seq.prompt_len] if p.repetition_penalty != 1.0 else []
        output_ids = seq.token_ids[seq.prompt_len :] if has_penalty(p) else []
        banned = tuple(self.eos_ids | set(p.stop_token_ids)) if num_outputs < p.min_tokens else ()
        return SamplingRow(p, prompt_ids, output_ids, draw.seed_key, banned, num_outputs)

    def _update(self, step: QueuedStep) -> list[RequestOutput]:
        """Apply a step's results: each request's strategy plans, the plan is applied, its output built. A
        request whose distribution was unusable, or whose update raises, fails alone."""
        results, invalid = step.results()
        self.executor.check()  # the results of a step whose group failed meanwhile mean nothing
        by_request: dict[Request, list[tuple[Draw, Any]]] = {}
        for req, draw, result in results:
            items = by_request.get(req)
            if items is None:
                by_request[req] = [(draw, result)]
            else:
                items.append((draw, result))
        outputs = []
        now = time.monotonic()  # when this step's tokens reach their requests (RequestOutput.metrics)
        for req, items in by_request.items():
            if self._requests.get(req.request_id) is not req:
                continue  # aborted while the step was in flight: abort_request reported it
            if req in invalid:
                message = (
                    "no usable next-token distribution: every token is banned, or the logits are not finite"
                )
                outputs += self._fail_request(req, message, step.index, fault=False)
                continue
            try:
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

    def _fail_step(self, sched: SchedulerOutput | None, prev: QueuedStep | None) -> list[str]:
        """Abort the requests a failed step touched: scheduled, swapped out (their copies may be torn), or
        waiting for the tokens of a deferred step that was not applied."""
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
        return list(ids)


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The given rows of the step's logits (the whole tensor when they are all of them, in order)."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[upload(rows, torch.int64, logits.device)]
