"""Warm-up before ready: every kernel specialisation a request can launch is compiled before the engine takes its
first request, so that no request after ready waits on a compile (on the H200 the first top-p request took
2.6 s, 17x the next one, compiling the sampler's kernel inside it).

Triton compiles a kernel the first time it is launched with a new specialisation: new constexprs (tile sizes,
the attention's DECODE / SPLIT_KV / SPLITS_POW2, the FP8 matmul's tile rows), new tensor dtypes or alignments,
an integer argument newly 1 or a multiple of 16. The model runner's CUDA graphs compile what decode steps and
small steps with prefill chunks launch; what runs outside them is warmed here, from two declared tables:
- SAMPLING_VARIANTS: each sampling path a request can take, run through the engine's sampler on a step's own
  logits (the model's dtype and layout; the kernel is compiled again for the float32 rows that penalties and
  banned tokens make), alone (its row gathered) and all together; a grammar's token mask; beam search's scores;
  logprobs. The grammar compiler's tokenizer view is built too (a second for a 128k vocabulary).
- `eager_steps`: forward passes that run outside the graphs (prompt scoring, steps past the largest graph,
  --enforce-eager), one per row count of ROW_COUNTS (the linear layers' dispatch by row count: the GEMVs, the
  FP8 and INT4 / INT8 matmuls' tiles, torch's matmuls beyond, each on both sides of 16's divisibility) and
  decodes at each power-of-two context length, one sequence, and without decode graphs batches of each
  power-of-two width (decode attention's kernel and split count follow the context and the width), through the
  executor, so on every tensor-parallel rank; the first step also copies a block (copy-on-write: the forks of
  n > 1, best_of and beam search) and swaps one out and in (preemption).

tests/engine/test_warmup.py checks the tables against the dispatch itself: every launched Triton kernel, every
specialisation that a sweep of step shapes and sampling parameters reaches, every field of SamplingParams. A new
kernel or sampling path fails it until it has an entry here. Nothing compiles on the CPU: there `warm_up` returns
at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields
from typing import Protocol

import torch

from tinypaged import compile_cache, ops
from tinypaged.config import EngineConfig
from tinypaged.core.scheduler import SchedulerOutput
from tinypaged.engine.device.executor import Executor
from tinypaged.engine.device.model_runner import ModelRunner, scratch_step
from tinypaged.engine.sampling.beam_search import BeamSearch
from tinypaged.engine.sampling.rejection import Verify, verify
from tinypaged.engine.sampling.sampler import Sampler, SamplingRow, upload
from tinypaged.engine.sampling.structured import GrammarCompiler, bitmask_width
from tinypaged.model.quant import fp8, lowbit
from tinypaged.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


class LLMEngine(Protocol):
    """The parts of an LLMEngine the warm-up runs (llm_engine.py calls it from its constructor)."""

    config: EngineConfig
    runner: ModelRunner
    executor: Executor
    sampler: Sampler
    grammars: GrammarCompiler
    eos_ids: frozenset[int]


@dataclass(frozen=True)
class SamplingVariant:
    """One sampling path: a request's parameters, and what the engine does to its row before the sampler."""

    name: str
    params: SamplingParams
    banned: bool = False  # EOS banned below min_tokens: float32 rows without penalties
    grammar: bool = False  # a grammar's token mask is applied to the row first


_T = 0.8
_SCHEMA = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
SAMPLING_VARIANTS: tuple[SamplingVariant, ...] = (
    SamplingVariant("greedy", SamplingParams(temperature=0.0)),
    SamplingVariant("temperature", SamplingParams(temperature=_T)),
    SamplingVariant("top_p", SamplingParams(temperature=_T, top_p=0.9)),
    SamplingVariant("top_k", SamplingParams(temperature=_T, top_k=20)),
    SamplingVariant("min_p", SamplingParams(temperature=_T, min_p=0.05)),
    SamplingVariant(
        "penalties",
        SamplingParams(temperature=_T, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
    ),
    SamplingVariant(
        "min_tokens", SamplingParams(temperature=_T, min_tokens=4, stop_token_ids=[1]), banned=True
    ),
    SamplingVariant("seed", SamplingParams(temperature=_T, seed=0)),
    SamplingVariant("logprobs", SamplingParams(temperature=_T, logprobs=5)),
    SamplingVariant("prompt_logprobs", SamplingParams(temperature=0.0, prompt_logprobs=5)),
    SamplingVariant("best_of", SamplingParams(temperature=_T, n=2, best_of=3)),
    SamplingVariant("beams", SamplingParams(temperature=0.0, n=2, use_beam_search=True)),
    SamplingVariant("grammar", SamplingParams(temperature=_T, structured_outputs=_SCHEMA), grammar=True),
)

# Fields of SamplingParams that change nothing on the device (host-side stops, detokenization, output shape,
# beam scoring on the host): every other field must be set away from its default by some variant above.
HOST_ONLY_FIELDS = frozenset(
    {
        "max_tokens",
        "stop",
        "include_stop_str_in_output",
        "ignore_eos",
        "skip_special_tokens",
        "length_penalty",
        "early_stopping",
        "output_kind",
    }
)

FP8_SWIGLU_TILED_ROWS = 256  # kernels/fp8.py's TILED_ROWS (not imported: the CPU engine never imports Triton)

# Row counts where a linear layer's dispatch changes kernel or tile: ops.linear's GEMV (its tile rows the next power
# of two) and skinny matmul (bf16 up to _SKINNY_ROWS, cuBLASLt beyond), the FP8 matmul (fp8.py: tiles of 16, 32, 64
# and 128 rows up to GEMM_ROWS, torch._scaled_mm beyond; the FP8 SwiGLU in tiles up to kernels/fp8.py's TILED_ROWS),
# the INT4 / INT8 kernels (lowbit.py: in groups of 128 through the Gluon kernel, INT4 up to MMA_ROWS, INT8 from
# INT8_MMA_MIN_ROWS to INT8_MMA_ROWS; the GEMV; the tensor-core kernel in tiles of 16, 32 and 64 rows; dequantize
# and matmul beyond). Each boundary's last row count and the next one: so each class is warmed once a multiple of 16
# and once not (Triton specialises an integer on its divisibility by 16). The sweep of tests/engine/test_warmup.py
# holds it against the kernels' own choices.
_BOUNDARIES = {
    ops._GEMV_ROWS, ops._SKINNY_ROWS, fp8.GEMM_ROWS, FP8_SWIGLU_TILED_ROWS, lowbit.GEMV_ROWS, lowbit.MMA_ROWS,
    lowbit.INT8_MMA_MIN_ROWS, lowbit.INT8_MMA_ROWS, lowbit.GEMM_ROWS, 2, 16, 32, 64, 128,
}  # fmt: skip
ROW_COUNTS: tuple[int, ...] = tuple(sorted({b + d for b in _BOUNDARIES for d in (0, 1) if b + d > 0}))


def needs_warmup(engine: LLMEngine) -> bool:
    """Whether anything would compile: the runner's ops go to Triton on a GPU."""
    runner = engine.runner
    return runner.device.type == "cuda" and ops.uses_triton(runner.kv_cache)


def eager_steps(
    config: EngineConfig, num_blocks: int, num_cpu_blocks: int = 0, decode_graphs: bool = False
) -> list[SchedulerOutput]:
    """The warm-up's forward passes outside the graphs: a prefill of each of ROW_COUNTS tokens (one sequence), a
    decode at each power-of-two context length (without `decode_graphs`, which replay every decode batch, also
    in batches of each power-of-two width up to max_num_seqs, as many tokens as the pool holds at most), then a
    decode batch whose logits the sampler's warm-up reads (as many rows as there are variants, up to
    max_num_seqs). The first step copies block 0 to block 1 and, with swap space, swaps block 2 out and back in
    as block 3 (what preemption by swap moves)."""
    bs = config.block_size
    longest = min(config.max_model_len, num_blocks * bs)
    steps = [
        scratch_step([(0, t)], bs) for t in ROW_COUNTS if t <= min(longest, config.max_num_batched_tokens)
    ]
    # Which decode attention kernel runs, and into how many splits, follows the context and the batch's width
    # (over an FP8 cache the Gluon kernel takes batches from 256 programs up; more sequences, fewer splits).
    most = config.max_num_seqs
    widths = [1] if decode_graphs else sorted({min(2**i, most) for i in range(most.bit_length() + 1)})
    for width in widths:
        context = bs
        while context <= longest and width * context <= num_blocks * bs:
            steps.append(scratch_step([(context - 1, 1)] * width, bs))
            context *= 2
    spec = config.speculative
    if spec is not None:  # verification: a decode with k proposed tokens, its k + 1 rows sampled
        k = spec.num_speculative_tokens
        steps += [scratch_step([(c, 1 + k)], bs, k) for c in (bs - 1, 2 * bs - 1) if c + 1 + k <= longest]
    rows = min(config.max_num_seqs, len(SAMPLING_VARIANTS))
    steps.append(scratch_step([(0, 1)] * rows, bs))
    copy = ((0, 1),) if num_blocks >= 2 else ()
    swap = num_blocks >= 4 and num_cpu_blocks >= 1
    first = steps[0]
    out, back = (((2, 0),), ((0, 3),)) if swap else ((), ())
    steps[0] = SchedulerOutput(first.scheduled, out, back, copy, (), (), first.num_batched_tokens)
    return steps


def warm_up(engine: LLMEngine, force: bool = False) -> float:
    """Compile every kernel specialisation a request can launch (see the module's docstring); returns the seconds
    it took. Does nothing unless `needs_warmup` (or `force`: tests, on the CPU).

    The work runs twice: first as a dry run whose launches only submit their compiles to a pool
    (`compile_cache.compile_only`: side by side instead of one after the other; one rank only, since a
    tensor-parallel worker runs its launches for real), then for real, which compiles whatever the dry run
    missed. The grammar compiler's tokenizer view is built meanwhile, in its own pool. The engine's host random
    stream is left as it was, so that unseeded sampling after it is what it would have been without."""
    if not (force or needs_warmup(engine)):
        return 0.0
    t0 = time.perf_counter()
    runner = engine.runner
    grammar = engine.grammars.submit(_SCHEMA)  # llguidance's view of the tokenizer, built once, in its pool
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        steps = eager_steps(
            engine.config, runner.num_gpu_blocks, runner.num_cpu_blocks, runner.use_cuda_graphs
        )
        if engine.config.tensor_parallel_size == 1:
            compile_cache.dry_run(lambda: _run(engine, steps), "warm-up")
        _run(engine, steps)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    try:  # structured outputs alone depend on it
        grammar.result()
    except Exception as e:  # noqa: BLE001 - the engine serves without it; a grammar request will say why
        logger.warning("warm-up: compiling a grammar failed (%s); structured outputs may not work", e)
    return time.perf_counter() - t0


def _run(engine: LLMEngine, steps: list[SchedulerOutput]) -> None:
    """The warm-up's steps through the executor, then the sampler's variants on the last one's logits."""
    for sched in steps[:-1]:
        out = engine.executor.execute(sched, (0,))
        k = sched.scheduled[0].num_spec_tokens
        if k and out is not None:  # verification's pass over the k + 1 rows, greedy and sampled
            rows = [
                SamplingRow(v.params, [0], [1], None, (), j)
                for v in SAMPLING_VARIANTS[:2]
                for j in range(k + 1)
            ]
            items = [Verify(rows[i * (k + 1) : (i + 1) * (k + 1)], (0,) * k) for i in range(2)]
            verify(engine.sampler, out.logits.repeat(2, 1), items)
    out = engine.executor.execute(steps[-1], (0,))
    assert out is not None
    _warm_sampler(engine, out.logits)
    engine.speculator.warm_up()  # a draft model's own kernels


def _warm_sampler(engine: LLMEngine, logits: torch.Tensor) -> None:
    """Each variant on one row gathered from the step's logits, then every row at once on the logits as they
    are (variants in turn), as `DrawBatch` hands them to the sampler, at the last four row counts."""
    eos = min(engine.eos_ids, default=0)
    rows = [_row(v, i, eos) for i, v in enumerate(SAMPLING_VARIANTS)]
    device, n = logits.device, logits.shape[0]
    for i, (variant, row) in enumerate(zip(SAMPLING_VARIANTS, rows, strict=True)):
        one = logits[upload([i % n], torch.int64, device)]
        _draw(engine, one, [variant], [row])
    # Several row counts: the sampler's per-row parameters go up as rows of one tensor, and Triton specialises
    # on a pointer's 16-byte alignment (the sampler pads the rows so that it does not vary; the test holds it).
    for k in range(n, max(0, n - 4), -1):
        picks = [i % len(rows) for i in range(k)]
        _draw(engine, logits[:k], [SAMPLING_VARIANTS[i] for i in picks], [rows[i] for i in picks])


def _row(variant: SamplingVariant, index: int, eos: int) -> SamplingRow:
    p = variant.params
    seed_key = index + 1 if p.seed is not None else None
    banned = (eos, *p.stop_token_ids) if variant.banned else ()
    return SamplingRow(p, [0, 1, 2], [1, 2, 2], seed_key, banned)


def _draw(
    engine: LLMEngine, logits: torch.Tensor, variants: list[SamplingVariant], rows: list[SamplingRow]
) -> None:
    """What one step does with these rows: grammar masks, then the sampler (or beam search's scores)."""
    masked = [i for i, v in enumerate(variants) if v.grammar]
    if masked:
        words = torch.full((len(masked), bitmask_width(logits.shape[1])), -1, dtype=torch.int32)
        ops.apply_token_bitmask(logits, words.to(logits.device), upload(masked, torch.int32, logits.device))
    beams = [i for i, v in enumerate(variants) if v.params.use_beam_search]
    if beams:
        scores = engine.sampler.beam_logprobs(logits[beams], [rows[i] for i in beams])
        _warm_beam_step(scores, min(engine.eos_ids, default=0))
    sampled = [i for i, v in enumerate(variants) if not v.params.use_beam_search]
    if sampled:
        best_of = any(rows[i].params.num_seqs > rows[i].params.n for i in sampled)
        part = logits if len(sampled) == len(rows) else logits[sampled]
        engine.sampler.sample(part, [rows[i] for i in sampled], need_logprobs=best_of).result()


def sampling_fields() -> set[str]:
    """The fields of SamplingParams a warm-up variant must cover (all but HOST_ONLY_FIELDS)."""
    return {f.name for f in fields(SamplingParams)} - HOST_ONLY_FIELDS


def start(engine: LLMEngine, started: float) -> tuple[tuple[str, float], ...]:
    """The end of an engine's start (`started`: its time.perf_counter() at the start): the warm-up, then the
    startup phases with their seconds (weights, KV cache, CUDA graph capture, warm-up, total), logged."""
    warm_s = warm_up(engine)
    stats = engine.runner.stats
    phases = (
        ("weights", stats.load_s),
        ("kv_cache", stats.kv_cache_s),
        ("graph_capture", stats.graph_capture_s),
        ("warmup", stats.warm_logits_s + warm_s),
        ("total", time.perf_counter() - started),
    )
    cache = f"; compile cache {stats.compile_cache}" if stats.compile_cache else ""
    logger.info("startup: %s%s", ", ".join(f"{name} {s:.2f} s" for name, s in phases), cache)
    return phases


def _warm_beam_step(scores: torch.Tensor, eos: int) -> None:
    """Beam search's step on the device, as a beam request runs it: the scores' check, then `BeamSearch.select`
    over one beam and over two, with a stop id in the vocabulary and at the length limit (its two branches).
    Nothing here compiles, but torch loads a kernel's module the first time it launches (CUDA's lazy loading):
    on the H200 the first beam request paid 0.06-0.08 s for those of the step's index arithmetic and merges."""
    torch.isfinite(scores.amax(dim=-1)).tolist()
    params = SamplingParams(temperature=0.0, n=2, use_beam_search=True)
    for beams in ([(0, 0.0)], [(0, 0.0), (1, -1.0)]):
        for limit in (8, 1):  # a stop id can end a beam; every candidate ends at the limit
            search = BeamSearch(params, frozenset({eos}), limit, None)  # type: ignore[arg-type]  # no detokenizing
            search.pending = {seq_id: scores[seq_id % scores.shape[0]] for seq_id, _ in beams}
            search.select(beams, 0)
